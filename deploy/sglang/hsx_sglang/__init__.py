"""hsx-sglang: an SGLang plugin that writes one hidden-state dump directory per hsx request.

The hook's decisions live in `capture` (no SGLang import, callable with objects shaped like
SGLang's), the files in `dumpdir`, the background writer in `writer`; `plugin` is the only
module that talks to SGLang.
"""

__version__ = "0.1.0"
