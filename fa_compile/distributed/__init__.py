"""fa-compile under torch.distributed: context parallelism (`context`: `fa_compile.context_parallel`,
ring attention over the sequence shards in `ring`) and the DTensor sharding rules of the fa3 ops
(`sharding`).

`import fa_compile` (which torch runs at `import torch`) imports this package for `sharding.install()`:
keep its import cheap (nothing of torch.distributed at module level here).
"""
from . import sharding
