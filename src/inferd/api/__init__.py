"""HTTP front end: OIP v2 (with Triton's binary tensor extension), OpenAI embeddings, metrics."""
