"""mini-grpo: a small GRPO trainer for language models (README.md, docs/architecture.md)."""

import os

# CPU tensors of 2 MiB and more on transparent huge pages: PyTorch's allocator aligns them and
# asks for huge pages (madvise) when this is set before its first allocation, which importing
# mini_grpo comes before in every entry point. A fresh buffer then faults its pages in once per
# 2 MiB instead of per 4 KiB: fewer page faults in every fresh activation, a faster policy
# pass at the same peak (measured: docs/results.md, bench/memory_sft_thp_*.json). Works
# where the kernel's THP setting is `madvise` (common) or `always`; THP_MEM_ALLOC_ENABLE=0
# keeps small pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
