"""ServerState: what every HTTP endpoint shares (the TokenizerManager, the model's names and
defaults, the server's options and liveness), apart from the app so that the endpoint modules
can name it without importing the app that imports them."""

from __future__ import annotations

from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt_lite.model_config import ModelConfig


class ServerState:
    """What the endpoints share: the manager, the launch info, options, and liveness."""

    def __init__(
        self,
        tokenizer_manager: TokenizerManager,
        model_config: ModelConfig,
        served_model_name: str,
    ):
        args = tokenizer_manager.server_args
        self.tm = tokenizer_manager
        model_dir = self.model_dir = model_config.path
        self.hf_config = model_config.hf_config
        self.served_model_name = served_model_name
        # Names a request's `model` may use: the served name and the path it was started with.
        self.model_names = {served_model_name, model_dir} | ({args.model_path} if args.model_path else set())
        self.generation_defaults = model_config.generation_defaults
        self.reasoning_parser = args.reasoning_parser
        self.tool_call_parser = args.tool_call_parser
        self.enable_cache_report = args.enable_cache_report
        self.api_key = args.api_key
        self.max_request_bytes = args.max_request_bytes
        self.chat_template = open(args.chat_template).read() if args.chat_template else None
        self.dead: str | None = None  # why the server cannot serve (a child process died)

    def unavailable(self) -> str | None:
        """Why new requests cannot be served now, or None."""
        if self.dead:
            return self.dead
        return "the server is shutting down" if self.tm.draining else None
