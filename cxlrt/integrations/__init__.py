"""Adapters that plug cxlrt into serving engines.

Each adapter lives in its own module and imports its engine lazily, so importing
this package never pulls in vLLM or LMCache:

- ``cxlrt.integrations.vllm``: ``CxlrtConnector``, a vLLM ``KVConnectorBase_V1``
  (install with ``pip install -e ".[vllm]"``).
"""
