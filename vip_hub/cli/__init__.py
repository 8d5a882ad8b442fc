"""The `vip-hub` command line: its core (plugins by entry point) and vip_hub's own sub-commands."""
