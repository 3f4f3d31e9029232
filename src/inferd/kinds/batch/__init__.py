"""The `batch` kind, dynamic batching: the pure policy (when to cut), the bounded queue, and the asyncio
dispatcher."""
