"""r3capture demo and end-to-end helpers (tiny model, server lifecycle, client checks)."""
