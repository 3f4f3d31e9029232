"""The worker wire, front-end side and shared by both ends: the messages and their framing (protocol.py),
and the front end's side of one worker connection (connection.py)."""
