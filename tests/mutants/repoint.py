"""Re-point planted bugs after code moved: python tests/mutants/repoint.py [NAME ...]

For each patch that no longer applies (all stale ones when no NAME is given), every hunk's
removed lines are looked for again, whitespace aside, first in the file the patch names, then
in every other source file of the tree; where they stand exactly once, the hunk's change is
made there (indented as the lines found) and the patch is written anew from ``git diff``,
its header lines kept. A hunk that only adds lines is anchored on its context instead.
What cannot be found once is left as it was and listed: re-point it by hand.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def tracked_sources(tree):
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                         check=True).stdout.decode().split("\0")
    return [f for f in out if f and not f.startswith("tests/")]


def copy_tree(tree):
    for f in tracked_sources(tree):
        os.makedirs(os.path.join(tree, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(REPO, f), os.path.join(tree, f))
    subprocess.run("git init -q && git add -A && git -c user.email=x -c user.name=x commit -qm base",
                   shell=True, cwd=tree, check=True)


def parse(text):
    """(header lines, [(path, [hunk lines])])"""
    lines = text.splitlines()
    header, files, hunk = [], [], None
    path = None
    for line in lines:
        if line.startswith("diff --git"):
            path = line.split(" b/", 1)[1]
            files.append([path, []])
            hunk = None
        elif line.startswith("+++ b/") and (not files or files[-1][1] or files[-1][0] != line[6:]):
            if not files or files[-1][0] != line[6:] or files[-1][1]:
                files.append([line[6:], []])  # a patch without "diff --git" lines
            hunk = None
        elif not files and not line.startswith(("--- ", "+++ ", "index ")):
            header.append(line)
        elif line.startswith("@@"):
            hunk = []
            files[-1][1].append(hunk)
        elif hunk is not None and line[:1] in (" ", "-", "+") and not line.startswith(("--- ", "+++ ")):
            hunk.append(line)
        elif hunk is not None and line == "":
            hunk.append(" ")
    return header, files


def find(lines, block):
    """Indices where ``block`` (stripped lines) starts in ``lines``."""
    stripped = [line.strip() for line in lines]
    want = [line.strip() for line in block]
    return [i for i in range(len(stripped) - len(want) + 1) if stripped[i:i + len(want)] == want]


def indent_of(line):
    return line[:len(line) - len(line.lstrip())]


def apply_hunk(tree, path, hunk, sources):
    old = [line[1:] for line in hunk if line[0] in " -"]
    new = [line[1:] for line in hunk if line[0] in " +"]
    # Try the whole old block, then with less and less context around the change.
    first = next(i for i, line in enumerate(hunk) if line[0] != " ")
    last = max(i for i, line in enumerate(hunk) if line[0] != " ")
    for context in (99, 3, 2, 1, 0):
        part = hunk[max(0, first - context):last + 1 + context]
        old = [line[1:] for line in part if line[0] in " -"]
        new = [line[1:] for line in part if line[0] in " +"]
        if not any(o.strip() for o in old):
            continue
        candidates = [path] + [s for s in sources if s != path and s.endswith(".py")]
        for candidate in candidates:
            full = os.path.join(tree, candidate)
            if not os.path.exists(full):
                continue
            lines = open(full).read().split("\n")
            spots = find(lines, old)
            if len(spots) == 1:
                at = spots[0]
                shift = indent_of(lines[at])
                base = indent_of(next(o for o in old if o.strip())) if old else ""
                first_real = next(k for k, o in enumerate(old) if o.strip())
                shift = indent_of(lines[at + first_real])
                moved = []
                for line in new:
                    if line.startswith(base):
                        moved.append(shift + line[len(base):] if line.strip() else line)
                    else:
                        moved.append(line)
                lines[at:at + len(old)] = moved
                open(full, "w").write("\n".join(lines))
                return candidate
            if len(spots) > 1 and candidate == path:
                break  # ambiguous in its own file: less context would not help
    return None


def repoint(name, tree):
    patch = os.path.join(HERE, name + ".patch")
    text = open(patch).read()
    header, files = parse(text)
    subprocess.run("git checkout -q -- . && git clean -qfd", shell=True, cwd=tree, check=True)
    sources = tracked_sources(tree)
    for path, hunks in files:
        for hunk in hunks:
            if apply_hunk(tree, path, hunk, sources) is None:
                return False
    diff = subprocess.run(["git", "diff"], cwd=tree, capture_output=True, text=True).stdout
    if not diff:
        return False
    with open(patch, "w") as f:
        f.write("\n".join(header) + "\n" + diff)
    return True


def applies(name):
    return subprocess.run(["git", "apply", "--check", os.path.join(HERE, name + ".patch")], cwd=REPO,
                          capture_output=True).returncode == 0


def main(names):
    names = names or [os.path.basename(p)[:-6] for p in sorted(glob.glob(os.path.join(HERE, "*.patch")))]
    stale = [n for n in names if not applies(n)]
    left = []
    with tempfile.TemporaryDirectory() as tree:
        copy_tree(tree)
        for name in stale:
            if not repoint(name, tree) or not applies(name):
                left.append(name)
    print(f"{len(stale)} stale, {len(stale) - len(left)} re-pointed")
    for name in left:
        print("by hand:", name)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
