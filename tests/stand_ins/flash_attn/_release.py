"""Which flash-attn release the stand-in presents: the environment variable below (read once,
at import, so ranks started by run_on_local_ranks present the same release as their parent)."""

import os
import re

VERSION_ENV = "MEGATRON_UL_TEST_FLASH_ATTN_VERSION"

# One release per calling convention of the private functions, plus the newest release
# (2.8 keeps 2.7's interface). `API` names the convention: "2.5", "2.6" or "2.7".
RELEASES = ("2.5.9.post1", "2.6.3", "2.7.4.post1", "2.8.3")
DEFAULT_RELEASE = "2.8.3"


def api_of(version: str) -> str:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or int(match.group(1)) != 2 or not 5 <= int(match.group(2)) <= 8:
        raise ImportError(
            f"the flash_attn stand-in models releases 2.5-2.8 ({VERSION_ENV}={version!r})"
        )
    minor = int(match.group(2))
    return "2.5" if minor == 5 else "2.6" if minor == 6 else "2.7"


VERSION = os.environ.get(VERSION_ENV) or DEFAULT_RELEASE
API = api_of(VERSION)
