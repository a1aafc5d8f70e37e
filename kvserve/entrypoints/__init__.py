"""What users run: the `kvserve` command line (cli), the OpenAI-compatible server (server)
and its replicas on Ray Serve with prefix-aware routing (ray_serve)."""
