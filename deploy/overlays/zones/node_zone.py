"""The zone of the node this pod runs on, for `--zone`: the init container `zone` of the zones overlay runs
it before inferd starts. Kubernetes does not hand a node's labels to its pods (the downward API has the
node's name, not its labels), so it asks the API server for this node (`get` on `nodes`, the ClusterRole
inferd-node-zone-reader, with a token mounted in this init container only) and writes the node's
`topology.kubernetes.io/zone` label to a file the inferd container reads into `--zone`.

Usage: python node_zone.py SECRETS_DIR OUT_FILE (SECRETS_DIR holds `token` and `ca.crt`; NODE_NAME and the
API server's KUBERNETES_SERVICE_HOST/PORT come from the environment). A node without a valid zone label
is an error that names the node and the fix: the pod does not start claiming no zone or a wrong one."""

from __future__ import annotations

import json
import os
import re
import ssl
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ZONE_LABEL = "topology.kubernetes.io/zone"
ZONE_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # inferd's rule for --zone


def node_zone(secrets: Path) -> str:
    node = os.environ["NODE_NAME"]
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    url = f"https://{host}:{port}/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    token = (secrets / "token").read_text().strip()
    context = ssl.create_default_context(cafile=str(secrets / "ca.crt"))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, context=context, timeout=10) as answer:
        labels = json.load(answer)["metadata"].get("labels") or {}
    zone = labels.get(ZONE_LABEL)
    if zone is None:
        raise SystemExit(
            f"node {node} has no {ZONE_LABEL} label: label it "
            f"(kubectl label node {node} {ZONE_LABEL}=ZONE) or deploy without the zones overlay"
        )
    if not ZONE_NAME.match(zone):
        raise SystemExit(f"node {node}: {ZONE_LABEL}={zone!r} is not a DNS label, which inferd's --zone needs")
    return zone


def main(argv: list[str]) -> None:
    secrets, out = Path(argv[1]), Path(argv[2])
    zone = node_zone(secrets)
    out.write_text(zone + "\n")  # a line: the shell's `read` wants its newline
    print(f"node {os.environ['NODE_NAME']}: zone {zone}")


if __name__ == "__main__":
    main(sys.argv)
