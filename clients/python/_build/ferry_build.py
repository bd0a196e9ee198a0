"""An in-tree PEP 517 build backend for ferry-client, so that the package builds with nothing fetched.

It writes a pure-Python wheel (the ``ferry_client`` package and its ``.dist-info``) and an sdist of this
folder. The metadata comes from ``pyproject.toml``'s ``[project]`` table (read with ``tomllib`` where
Python has it, 3.11+, else from the few keys this file uses, by a small reader).
"""
import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ferry_client"


def _project():
    path = os.path.join(ROOT, "pyproject.toml")
    with open(path, "rb") as f:
        data = f.read()
    try:
        import tomllib  # Python 3.11+

        return tomllib.loads(data.decode("utf-8"))["project"]
    except ImportError:
        project = {}
        section = None
        for line in data.decode("utf-8").splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
                continue
            match = re.match(r'^([a-z-]+)\s*=\s*"([^"]*)"$', line)
            if section == "project" and match:
                project[match.group(1)] = match.group(2)
        return project


def _names():
    project = _project()
    name = project["name"]
    version = project["version"]
    return name, version, name.replace("-", "_")


def _metadata():
    project = _project()
    readme = ""
    readme_path = os.path.join(ROOT, "README.md")
    if os.path.exists(readme_path):
        with open(readme_path, encoding="utf-8") as f:
            readme = f.read()
    lines = [
        "Metadata-Version: 2.1",
        "Name: %s" % project["name"],
        "Version: %s" % project["version"],
        "Summary: %s" % project.get("description", ""),
        "Requires-Python: %s" % project.get("requires-python", ">=3.9"),
        "License: Apache-2.0",
        "Description-Content-Type: text/markdown",
        "",
        readme,
    ]
    return "\n".join(lines)


def _package_files():
    base = os.path.join(ROOT, PACKAGE)
    for folder, _dirs, files in os.walk(base):
        _dirs[:] = [d for d in _dirs if d != "__pycache__"]
        for name in sorted(files):
            if name.endswith((".py", ".typed")):
                full = os.path.join(folder, name)
                yield full, os.path.relpath(full, ROOT).replace(os.sep, "/")


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _name, version, dist = _names()
    info = "%s-%s.dist-info" % (dist, version)
    os.makedirs(os.path.join(metadata_directory, info), exist_ok=True)
    with open(os.path.join(metadata_directory, info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    return info


WHEEL_FILE = b"Wheel-Version: 1.0\nGenerator: ferry_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _write_wheel(wheel_directory, entries):
    """Writes the wheel of ``entries`` (path, bytes) with its METADATA, WHEEL and RECORD; its file name."""
    _name, version, dist = _names()
    filename = "%s-%s-py3-none-any.whl" % (dist, version)
    info = "%s-%s.dist-info" % (dist, version)
    entries = list(entries) + [(info + "/METADATA", _metadata().encode("utf-8")), (info + "/WHEEL", WHEEL_FILE)]
    records = [_record_line(path, data) for path, data in entries] + [info + "/RECORD,,"]
    entries.append((info + "/RECORD", ("\n".join(records) + "\n").encode("utf-8")))
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in entries:
            # A fixed date: the same sources make the same wheel.
            entry = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            wheel.writestr(entry, data, zipfile.ZIP_DEFLATED)
    return filename


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = []
    for full, rel in _package_files():
        with open(full, "rb") as f:
            files.append((rel, f.read()))
    return _write_wheel(wheel_directory, files)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 660: a wheel whose .pth file puts this folder on sys.path."""
    _name, _version, dist = _names()
    return _write_wheel(wheel_directory, [("%s.pth" % dist, (ROOT + "\n").encode("utf-8"))])


def get_requires_for_build_editable(config_settings=None):
    return []


def build_sdist(sdist_directory, config_settings=None):
    _name, version, dist = _names()
    base = "%s-%s" % (dist, version)
    filename = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, filename), "w:gz") as tar:
        for rel in ["pyproject.toml", "README.md", "_build/ferry_build.py"]:
            tar.add(os.path.join(ROOT, rel), arcname=base + "/" + rel)
        for full, rel in _package_files():
            tar.add(full, arcname=base + "/" + rel)
        pkg_info = _metadata().encode("utf-8")
        entry = tarfile.TarInfo(base + "/PKG-INFO")
        entry.size = len(pkg_info)
        tar.addfile(entry, io.BytesIO(pkg_info))
    return filename
