"""The serving runtime: engine, scheduler, KV block pool, model code and the HTTP server."""
