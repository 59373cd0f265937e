"""The HTTP service: FastAPI app, load jobs, schemas, settings."""
