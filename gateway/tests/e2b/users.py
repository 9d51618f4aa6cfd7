"""The unmodified E2B Python SDK naming users on the default driver (oci, the built-in image,
which has E2B's `user`), for gateway/tests/e2b_sdk.rs: `user="user"` runs commands as `user`
in /home/user with its HOME, writes files it owns and resolves relative paths in its home,
and so does a call that names no user, as on E2B;
`user="root"` is root in /root; a symlink's info is what it leads to, with its target (a
dangling one has neither); a user the sandbox does not have is refused naming it.

Environment: E2B_API_URL and E2B_SANDBOX_URL (sbxd's --e2b-listen), E2B_API_KEY. Prints one
line per check; any failure raises.
"""

from e2b import FileType, Sandbox


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail!r}")
    print(f"ok {what}")


sbx = Sandbox.create(timeout=600)
who = 'id -un; id -u; pwd; echo "$HOME"'
ran = sbx.commands.run(who, user="user")
check("a command as user", ran.stdout == "user\n1000\n/home/user\n/home/user\n", ran.stdout)
ran = sbx.commands.run(who)
check("a command naming no user runs as user", ran.stdout == "user\n1000\n/home/user\n/home/user\n", ran.stdout)
ran = sbx.commands.run(who, user="root")
check("a command as root", ran.stdout == "root\n0\n/root\n/root\n", ran.stdout)
sbx.commands.run("mkdir -p work", user="user")
ran = sbx.commands.run("pwd", user="user", cwd="work")
check("a relative cwd is under the user's home", ran.stdout == "/home/user/work\n", ran.stdout)

sbx.files.write("notes.txt", "hi", user="user")
check("read back as user", sbx.files.read("notes.txt", user="user") == "hi")
owner = sbx.commands.run("stat -c '%U %G' /home/user/notes.txt", user="root").stdout
check("a file written by user is user's, in its home", owner == "user user\n", owner)
sbx.files.write("plain.txt", "p")
owner = sbx.commands.run("stat -c '%U' /home/user/plain.txt", user="root").stdout
check("a file written naming no user is user's, in its home", owner == "user\n", owner)
check("read back naming no user", sbx.files.read("plain.txt") == "p")
sbx.files.write("/tmp/by-root.txt", "r", user="root")
owner = sbx.commands.run("stat -c '%U' /tmp/by-root.txt", user="root").stdout
check("a file written by root is root's", owner == "root\n", owner)

# As envd answers: a symlink is the type and mode of what it leads to, with its target.
sbx.commands.run("mkdir -p /tmp/real && chmod 750 /tmp/real && ln -s /tmp/real /tmp/link "
                 "&& ln -s /nowhere /tmp/dangling", user="root")
link = sbx.files.get_info("/tmp/link")
check("a symlink to a directory is a directory, with its target",
      (link.type, link.symlink_target, link.mode) == (FileType.DIR, "/tmp/real", 0o750), link)
dangling = sbx.files.get_info("/tmp/dangling")
check("a dangling symlink has no type and no target",
      (dangling.type, dangling.symlink_target) == (None, None), dangling)
listed = {e.name: e for e in sbx.files.list("/tmp")}
check("a listing says the same", listed["link"].symlink_target == "/tmp/real", listed["link"])

try:
    sbx.commands.run("true", user="nobody-here")
    check("an unknown user is refused", False, "it ran")
except Exception as e:  # the SDK's own exception for the daemon's refusal
    check("an unknown user is refused naming it", "nobody-here" in str(e), str(e))
check("kill", sbx.kill() is True)
print("done")
