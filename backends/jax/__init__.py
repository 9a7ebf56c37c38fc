"""The JAX backend: parlay programs on shard_map (explicit collectives) or jit with shardings
(GSPMD). Importing this package does not start JAX; its modules do."""
