"""
A function that uses all three things its image adds to python:3.12-slim:

- the `file` command, installed by `apt = ["file"]` (the slim image has none);
- /opt/image-app/banner.txt, written by the `run` step, found through IMAGE_APP_BANNER from `env`;
- the `humanize` package, installed into the image from requirements.txt.

    curl -X POST .../image-app/run -H 'content-type: application/json' -d '{"text": "Hello!"}'
"""

import os
import platform
import subprocess

import humanize


def run(text: str = "Hello from my own image!") -> dict:
    data = text.encode()
    kind = subprocess.run(["file", "--brief", "-"], input=data, capture_output=True, check=True)
    with open(os.environ["IMAGE_APP_BANNER"]) as f:
        banner = f.read().strip()
    return {
        "python": platform.python_version(),
        "file_says": kind.stdout.decode().strip(),
        "size": humanize.naturalsize(len(data)),
        "banner": banner,
    }
