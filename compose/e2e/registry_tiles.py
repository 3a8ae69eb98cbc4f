"""Tiles each worker reports done, from a hub's registry read with the operators' credential, printed as one
JSON line `{"<worker id>": tiles, ...}` (workers whose id starts with PREFIX, when given). Used by compose's
e2e and the sites test.

    python compose/e2e/registry_tiles.py tls://hub:4222 auth/admin.nk auth/tls/ca.pem [PREFIX]
"""

import asyncio
import json
import logging
import ssl
import sys
from pathlib import Path

from cleave import bus as busmod
from cleave.runtime.logs import configure
from cleave.schemas import REGISTRY_BUCKET, DeviceRecord


async def main(url: str, seed: str, ca: str, prefix: str) -> None:
    # (keys as the services list them: nats-py's kv.keys() can find none on a busy server)
    bus = await busmod.connect(url, "registry-tiles", nkeys_seed_str=seed, tls=ssl.create_default_context(cafile=ca))
    try:
        kv = await bus.kv(REGISTRY_BUCKET)
        records = {key: await bus.kv_get(kv, key, DeviceRecord) for key in await bus.keys(kv) if key.startswith(prefix)}
        print(json.dumps({key: r[0].tiles_done for key, r in records.items() if r is not None}))
    finally:
        await bus.close()


if __name__ == "__main__":
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # its note on a TLS connection's end
    configure("registry-tiles", level="warning")  # (to stderr: stdout is the JSON line alone)
    url, seed_file, ca = sys.argv[1:4]
    seed = Path(seed_file).read_text().strip()
    asyncio.run(asyncio.wait_for(main(url, seed, ca, sys.argv[4] if len(sys.argv) > 4 else ""), 60))
