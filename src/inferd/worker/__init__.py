"""Worker processes (one per device), the wire protocol, and the front end's side of each connection."""
