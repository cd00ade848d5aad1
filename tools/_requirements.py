"""What tools/_env.sh installs beside a pre-release torch (NGC containers' 2.6.0a0+nv... builds).

Why: PEP 440 orders 2.6.0a0 before 2.6.0, so megatron-core's own `torch>=2.6.0` refuses such a
build, and pip would either replace the machine's torch (never allowed: tools/_env.sh pins it) or
stop. Beside a pre-release torch, _env.sh installs the project and megatron-core without their
dependencies and then everything else they require, read here from the installed metadata.

    python tools/_requirements.py --torch-is-prerelease     exit 0 when the installed torch is one
    python tools/_requirements.py DIST [EXTRA ...]          DIST's requirements (with EXTRAs), one
                                                            a line, less torch and megatron-core
"""
from __future__ import annotations

import sys
from importlib import metadata

SKIP = {"torch", "megatron-core"}  # the machine's torch; megatron-core is installed with --no-deps


def requirements(dist: str, extras: list[str]) -> list[str]:
    """DIST's installed requirements that apply here with `extras`, markers resolved, less SKIP."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    selected = []
    for text in metadata.requires(dist) or []:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) in SKIP:
            continue
        if requirement.marker is not None and not any(requirement.marker.evaluate({"extra": extra})
                                                      for extra in ["", *extras]):
            continue
        requirement.marker = None
        selected.append(str(requirement))
    return selected


def torch_is_prerelease() -> bool:
    from packaging.version import Version

    return Version(metadata.version("torch")).is_prerelease


def main(argv: list[str]) -> int:
    if argv == ["--torch-is-prerelease"]:
        return 0 if torch_is_prerelease() else 1
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements(argv[0], argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
