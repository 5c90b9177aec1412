"""Structured outputs end to end: response_format and SGLang's grammar extras, through the
official `openai` client and LangChain, against the default model (whose template knows no
tools or JSON mode: only the grammar makes its output valid)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from openai_helpers import MODEL, assert_kv_idle, client_for, post_error

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


@pytest.fixture(autouse=True)
def kv_idle_after(server):
    yield
    assert_kv_idle(server)


def test_json_schema_greedy_and_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=PERSON_FORMAT, temperature=0, max_tokens=80)
    choice = r.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"  # the grammar ended the output
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=PERSON_FORMAT, temperature=0, max_tokens=80, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content


def test_json_schema_sampled_is_valid_and_seeded(client):
    kwargs = dict(model=MODEL, messages=ASK, response_format=PERSON_FORMAT, temperature=1.0, seed=7, n=2, max_tokens=80)
    a = client.chat.completions.create(**kwargs)
    for choice in a.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    b = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in b.choices] == [c.message.content for c in a.choices]


def test_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=60,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_completions_regex_and_response_format(client):
    r = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0, extra_body={"regex": " ?(yes|no)"}
    )
    assert r.choices[0].text.strip() in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL, prompt="A person as JSON:", max_tokens=80, temperature=0,
        extra_body={"response_format": PERSON_FORMAT},
    )
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_chat_ebnf(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a color."}], temperature=0, max_tokens=10,
        extra_body={"ebnf": 'root ::= "red" | "green" | "blue"'},
    )
    assert r.choices[0].message.content in ("red", "green", "blue")


@pytest.mark.parametrize(
    "path,body,named",
    [
        (
            "/v1/chat/completions",
            {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}},
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"messages": ASK, "regex": "(unclosed"}, "regex"),
        ("/v1/completions", {"prompt": "x", "regex": "[z-a]"}, "regex"),
        ("/v1/chat/completions", {"messages": ASK, "ebnf": "root ::= "}, "ebnf"),
        ("/v1/chat/completions", {"messages": ASK, "regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"prompt": "x", "regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
        ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_invalid_grammars_are_400_naming_the_field(server, path, body, named):
    err = post_error(server, path, body)
    assert named in err["message"], err


def test_langchain_structured_output(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int

    llm = ChatOpenAI(base_url=server.base_url + "/v1", api_key="x", model=MODEL, temperature=0, max_tokens=80, max_retries=0)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a person with a name and an age.")
    assert isinstance(person, Person)


def test_concurrent_half_constrained_requests_leave_the_free_ones_unchanged(client):
    """8 requests at once, every other one with a schema: the free ones' greedy text equals
    their text alone, and every constrained one validates."""
    from concurrent.futures import ThreadPoolExecutor

    questions = [f"Tell me one fact about the number {i}." for i in range(8)]

    def ask(i: int) -> str:
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": questions[i]}], temperature=0, max_tokens=40)
        if i % 2:
            kwargs["response_format"] = PERSON_FORMAT
        return client.chat.completions.create(**kwargs).choices[0].message.content

    alone = {i: ask(i) for i in range(0, 8, 2)}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert {i: together[i] for i in range(0, 8, 2)} == alone
    for i in range(1, 8, 2):
        jsonschema.validate(json.loads(together[i]), PERSON)


class City(BaseModel):
    name: str = Field(max_length=20)
    population_millions: float


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_model_with_a_float(server, mode):
    """A float field used to let the model write digits until max_tokens (instructor then
    raises IncompleteOutputException): the grammar bounds a number's digits."""
    import instructor

    client = instructor.from_openai(client_for(server), mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(
        model=MODEL, response_model=City, messages=[{"role": "user", "content": "Describe the city of Tokyo."}],
        temperature=0, max_tokens=200, max_retries=0,
    )
    assert isinstance(city, City) and isinstance(city.population_millions, float)


def test_pydantic_ai_agent_returns_a_model_with_a_float(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server.base_url + "/v1", api_key="unused"))
    # With parallel calls allowed, tool_choice "required" admits an array of calls, and the
    # small model repeats its final_result call until max_tokens (pydantic-ai keeps the first).
    settings = {"temperature": 0, "max_tokens": 200, "parallel_tool_calls": False}
    agent = Agent(model, output_type=City, model_settings=settings)
    result = agent.run_sync("Describe the city of Tokyo.")
    assert isinstance(result.output, City) and isinstance(result.output.population_millions, float)
    assert result.usage.output_tokens < 200  # it ended on its own, not at max_tokens
