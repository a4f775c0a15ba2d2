#!/usr/bin/env python3
"""Checks that cpp/ includes only downward, as cpp/README.md lays out.

    python cpp/check_layers.py

Exits 1 naming each file and include that breaks the rule, 0 otherwise.
"""
import os
import re
import sys

CPP = os.path.dirname(os.path.abspath(__file__))
CORE = os.path.join(CPP, "core")

# cpp/core's folders, lowest first: a file may include its own folder and those below it.
LAYERS = ["common", "transports", "execution", "negotiation", "engine"]
# What the code outside cpp/core may include from it.
OUTSIDE = {
    "tf": {"common", "engine"},
    # The binding also exposes the CUDA part's loader and the link probe's arithmetic.
    "python": {"common", "engine", "transports"},
    # Only the C interface between the engine and libtfmpi_cuda.so.
    "cuda": {"transports/cuda_api.h"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def allowed(folder, target):
    """Whether a file in cpp/`folder` (or cpp/core/`folder`) may include `target`."""
    layer = target.split("/", 1)[0]
    if folder in LAYERS:
        return layer in LAYERS and LAYERS.index(layer) <= LAYERS.index(folder)
    return layer in OUTSIDE[folder] or target in OUTSIDE[folder]


def main():
    errors = []
    for top in sorted(os.listdir(CPP)):
        if not os.path.isdir(os.path.join(CPP, top)):
            continue
        for dirpath, _, names in sorted(os.walk(os.path.join(CPP, top))):
            for name in sorted(names):
                if not name.endswith((".h", ".cc", ".cu")):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, CPP)
                parts = rel.split(os.sep)
                if top == "core":
                    if len(parts) != 3 or parts[1] not in LAYERS:
                        errors.append(f"{rel}: cpp/core/ files live in one of {', '.join(LAYERS)}")
                        continue
                    folder = parts[1]
                elif top in OUTSIDE:
                    folder = top
                else:
                    errors.append(f"{rel}: unknown folder cpp/{top}/ (add it to check_layers.py and cpp/README.md)")
                    continue
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for target in INCLUDE.findall(text):
                    if target.startswith(("tensorflow/", "xla/")):
                        continue
                    if not os.path.isfile(os.path.join(CORE, target)):
                        errors.append(f'{rel}: #include "{target}" is not a path under cpp/core/')
                    elif not allowed(folder, target):
                        errors.append(f'{rel}: #include "{target}" runs against the layer order '
                                      f'({" <- ".join(LAYERS)}; see cpp/README.md)')
    for e in errors:
        print(e)
    if errors:
        return 1
    print("cpp/: every include follows cpp/README.md's layer order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
