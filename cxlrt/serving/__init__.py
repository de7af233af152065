"""Disaggregated LLM serving on cxlrt: the parts behind ``cxlrt demo``.

``config``     shapes and plans, cheap to import (the CLI reads them for ``--help``)
``model``      a tiny numpy decoder-only transformer with fixed random weights and explicit KV
``workload``   a deterministic multi-turn chat workload sharing one system prompt
``handoff``    the prefill -> decode message, for a cxlrt Channel and for TCP
``workers``    the prefill, decode and colocated worker processes of each mode
``scheduler``  starts a mode's workers, feeds them requests, collects the answers
``report``     per-turn and overall numbers, and the table

Everything here needs only numpy (and threadpoolctl, to keep each worker on one
BLAS thread): no torch.
"""
