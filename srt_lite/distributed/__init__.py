from srt_lite.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    init_distributed,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = ["get_tp_rank", "get_tp_size", "init_distributed", "tp_all_gather", "tp_all_reduce"]
