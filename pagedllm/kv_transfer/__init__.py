"""KV connectors: move KV cache blocks between the paged device cache and a store outside it (base.py, factory.py,
one file per connector)."""
