"""Imported once by the forkserver that the scheduler ranks and the detokenizer fork from
(srt_lite/entrypoints/child_processes.py), so that each child starts with these modules loaded.

Importing torch and the scheduler's modules is most of a child's start-up
CPU time; with `spawn` every child paid it again, on the same cores as its siblings.
Nothing here may run a torch op or start a thread: a forked child must get a clean OpenMP
pool and its own environment (the launcher hands each child its parent's os.environ).
"""

try:  # initialised here, before a child swaps its environment (it relocates environ)
    import setproctitle

    setproctitle.setproctitle("srt_lite::forkserver")
except ImportError:
    pass
# Not transformers (seconds more): the children read configs and tokenizers without it
# (model_loader.hf_config, model_loader.tokenizer_cache).
import tokenizers  # noqa: F401

import srt_lite.managers.detokenizer.detokenizer_manager  # noqa: F401
import srt_lite.managers.scheduler.scheduler  # noqa: F401
