"""The request core below the edges (api/: HTTP) and the gateway's layers (gateway/), with no wire in it:
the request's Call, the Reply a chain returns, Handler, Layer and chain() (call.py), the call's tenant
(tenant.py), and the Departure hook on a caller that goes away, with until_disconnect (disconnect.py)."""
