"""A folder round trip: send a local directory, let the server change it, bring it back.

`upload_folder` snapshots a local directory into file uploads under a path of the
request's private working directory (the function's current directory on the server);
`return_folder` reads a directory there after the program ran and returns it as a
`ReturnedFolder`, which `save()` writes to a new local directory.  Here the server counts
the words of every uploaded text file and writes `summary.txt` next to them.  Prints the
files sent, the files that came back (the summary included) and the summary's contents.
"""

import os
import pathlib
import tempfile

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

SOURCE = """
import pathlib

def summarize(folder):
    root = pathlib.Path(folder)  # relative: the request's working directory is the cwd
    lines = [f"{path.relative_to(root)}: {len(path.read_text().split())} words"
             for path in sorted(root.rglob("*.txt"))]
    (root / "summary.txt").write_text("\\n".join(lines) + "\\n")
    return len(lines)
"""


def make_project(root: pathlib.Path) -> None:
    (root / "notes").mkdir(parents=True)
    (root / "readme.txt").write_text("a folder sent to the server\n")
    (root / "notes" / "todo.txt").write_text("check the kernel then benchmark it\n")


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        local = pathlib.Path(scratch, "project")
        make_project(local)
        print("sent:", sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()))

        program = Program()
        program.upload_folder(local, path="project")  # project/readme.txt, project/notes/todo.txt
        summarize = program.get_function(module=program.upload(kind="module", source=SOURCE), name="summarize")
        program.return_(key="count", value=program.run(fn=summarize, args=["project"]))
        program.return_folder(key="project", path="project")
        with Client(URL) as client:
            result = client.execute(program)
        if not result.completed:
            raise SystemExit(f"{result.error['kind']}: {result.error['message']}")

        returned = result["project"]  # a ReturnedFolder: in memory until saved
        print("returned:", sorted(returned.files))
        saved = returned.save(os.path.join(scratch, "project-back"))  # the destination must not exist
        print(f"summary of {result['count']} files:")
        print((saved / "summary.txt").read_text(), end="")


if __name__ == "__main__":
    main()
