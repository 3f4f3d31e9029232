"""`inferd fleet-sim`: a discrete-event simulation of an inferd fleet on a virtual clock that runs inferd's
own runtime and policy objects (batching, admission, routing, ejection, hedging, recovery), with devices
from cost models fitted on measured runs."""
