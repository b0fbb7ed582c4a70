"""Write stdlib_docstrings.txt: the documentation strings of the CPython standard library, as prose.

Run with the Python whose standard library you want (the shipped file was made with CPython 3.11.7):

    python examples/data/make_corpus.py > examples/data/stdlib_docstrings.txt

The standard library's top-level modules and packages in name order (tests, IDLE, lib2to3, ensurepip,
turtledemo and site-packages left out), each file's module, class and function docstrings in source order,
cleaned up with inspect.cleandoc; only docstrings of at least 200 characters of printable ASCII with more
letters than anything else (prose, not tables or code). It stops before LIMIT bytes. Deterministic for one
Python version: no timestamps, no randomness.
"""

import ast
import inspect
import os
import sys
import sysconfig

LIMIT = 300_000
SKIP = {"test", "idlelib", "lib2to3", "ensurepip", "turtledemo", "site-packages", "__pycache__", "tkinter"}


def sources(root: str) -> list[str]:
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name in SKIP or name.startswith((".", "_")) and name != "__future__.py":
            continue
        if name.endswith(".py"):
            out.append(path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
            for d, dirs, files in os.walk(path):
                dirs[:] = sorted(x for x in dirs if x not in SKIP and not x.startswith("test"))
                out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def docstrings(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        try:
            tree = ast.parse(f.read())
        except SyntaxError:
            return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    out = []
    for n in nodes:
        doc = ast.get_docstring(n, clean=False)
        if not doc:
            continue
        doc = inspect.cleandoc(doc)
        letters = sum(c.isalpha() for c in doc)
        if (
            len(doc) >= 200
            and doc.isascii()
            and all(c.isprintable() or c == "\n" for c in doc)
            and letters > len(doc) / 2
        ):
            out.append(doc)
    return out


def main() -> None:
    root = sysconfig.get_paths()["stdlib"]
    size = 0
    for path in sources(root):
        for doc in docstrings(path):
            text = doc + "\n\n"
            if size + len(text) > LIMIT:
                return
            sys.stdout.write(text)
            size += len(text)


if __name__ == "__main__":
    main()
