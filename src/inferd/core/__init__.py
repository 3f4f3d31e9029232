"""The request core below the HTTP edges (api/) and the gateway's layers (gateway/): the minimal ASGI layer
(asgi.py, disconnect.py) and the request's Call, Handler, Layer and chain() (call.py)."""
