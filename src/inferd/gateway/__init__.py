"""The gateway: who is calling (tenants and API keys), how much they may use (quotas), what is answered
from cache, and how traffic is split between model versions. Each part is a middleware layer or a plain
policy object the layers drive."""
