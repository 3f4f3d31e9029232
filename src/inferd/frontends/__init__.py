"""More than one front-end process: `inferd serve --frontends N` (plan, parent, child, merged metrics)."""
