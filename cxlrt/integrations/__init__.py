"""Adapters that plug cxlrt into serving stacks.

Each adapter lives in its own module and imports its engine lazily, so importing
this package never pulls in vLLM or LMCache:

- ``cxlrt.integrations.vllm``: ``CxlrtConnector``, a vLLM ``KVConnectorBase_V1``
  (install with ``pip install -e ".[vllm]"``);
- ``cxlrt.integrations.lmcache``: ``CxlrtL2Adapter``, an LMCache L2 adapter plugin.
"""
