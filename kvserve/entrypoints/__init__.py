"""What users run: the `kvserve` command line (cli), the OpenAI-compatible server (server)
and the replica router (router)."""
