"""Plugins that put cxlrt inside serving stacks (each imports its engine only when used)."""
