"""
A function Ferry can run. Every function defined here whose name does not start with `_` is callable at
POST /v4/<project_id>/python-hello/<function>; the members of the JSON body are its keyword arguments:

    curl -X POST .../python-hello/run -H 'content-type: application/json' -d '{"name": "Ferry"}'
"""


def run(name: str = "world", greeting: str = "Hello") -> dict:
    return {"message": f"{greeting}, {name}!"}


def _helper() -> str:
    """Not callable from outside: the leading underscore keeps it private."""
    return "private"
