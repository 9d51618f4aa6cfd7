//! Who the image's `User` is: the same resolution for the oci driver (on the host, from the
//! sandbox's rootfs) and a vm guest (inside it, from its root disk).

/// Who a process runs as, inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProcessUser {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
}

/// Who a process runs as, with what its environment says of it: its name (`USER`, `LOGNAME`)
/// and home (`HOME`, and where an exec without a directory starts).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Account {
    pub ids: ProcessUser,
    /// The passwd entry's name; a uid without an entry is named by its number.
    pub name: String,
    /// The passwd entry's home; without an entry `/` (`/root` for uid 0, as Docker says).
    pub home: String,
}

/// Resolves an image's `User` (`""`, `uid`, `uid:gid`, `name`, `name:group`, …) against the
/// contents of its `/etc/passwd` and `/etc/group` (read only when needed). A numeric uid
/// without a gid takes the passwd entry's group when there is one, else 0. A name that is
/// not there is an error naming it.
pub fn resolve(
    user: &str,
    passwd: impl FnOnce() -> String,
    group: impl FnOnce() -> String,
) -> Result<ProcessUser, String> {
    if user.is_empty() {
        return Ok(ProcessUser::default());
    }
    account(user, passwd, group).map(|a| a.ids)
}

/// [`resolve`], with the account's name and home; an empty `user` is root (uid 0).
pub fn account(
    user: &str,
    passwd: impl FnOnce() -> String,
    group: impl FnOnce() -> String,
) -> Result<Account, String> {
    let user = if user.is_empty() { "0" } else { user };
    let (who, grp) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = passwd();
    // name:x:uid:gid:...
    let entry = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        let (name, uid, gid) = (
            f.first()?,
            f.get(2)?.parse::<u32>().ok()?,
            f.get(3)?.parse::<u32>().ok()?,
        );
        let home = f.get(5).copied().unwrap_or("");
        (*name == who || who.parse::<u32>() == Ok(uid))
            .then(|| (name.to_string(), uid, gid, home.to_string()))
    });
    let uid = match who.parse::<u32>() {
        Ok(uid) => uid,
        Err(_) => match &entry {
            Some((_, uid, _, _)) => *uid,
            None => return Err(format!("user {who:?} is not in the image's /etc/passwd")),
        },
    };
    let groups = group();
    let gid = match grp {
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => groups
                .lines()
                .find_map(|line| {
                    let f: Vec<&str> = line.split(':').collect();
                    (f.first() == Some(&g)).then(|| f.get(2)?.parse::<u32>().ok())?
                })
                .ok_or_else(|| format!("group {g:?} is not in the image's /etc/group"))?,
        },
        None => entry.as_ref().map(|(_, _, gid, _)| *gid).unwrap_or(0),
    };
    // Supplementary groups: those that list the user's name.
    let additional_gids = match &entry {
        Some((name, _, _, _)) => groups
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split(':').collect();
                let members = f.get(3)?;
                let gid = f.get(2)?.parse::<u32>().ok()?;
                (members.split(',').any(|m| m == name) && gid != 0).then_some(gid)
            })
            .collect(),
        None => Vec::new(),
    };
    let (name, home) = match entry {
        Some((name, _, _, home)) if home.starts_with('/') => (name, home),
        Some((name, ..)) => (name, "/".to_string()),
        None if uid == 0 => ("root".to_string(), "/root".to_string()),
        None => (uid.to_string(), "/".to_string()),
    };
    Ok(Account {
        ids: ProcessUser {
            uid,
            gid,
            additional_gids,
        },
        name,
        home,
    })
}

/// A small regular file's text (at most 1 MiB), or nothing: a FIFO or a device where a
/// name is looked up is read as no file, never waited on.
pub(crate) fn read_small(path: &str) -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
    else {
        return String::new();
    };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return String::new();
    }
    let mut text = String::new();
    let _ = file.take(1 << 20).read_to_string(&mut text);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nstaff:x:50:app\napps:x:1001:\n";

    fn check(user: &str) -> Result<ProcessUser, String> {
        resolve(user, || PASSWD.to_string(), || GROUP.to_string())
    }

    #[test]
    fn users_resolve_by_number_and_name() {
        let user = |uid, gid, extra: &[u32]| ProcessUser {
            uid,
            gid,
            additional_gids: extra.to_vec(),
        };
        assert_eq!(check("").unwrap(), user(0, 0, &[]));
        assert_eq!(check("app").unwrap(), user(1000, 1001, &[50]));
        assert_eq!(check("1000").unwrap(), user(1000, 1001, &[50]));
        assert_eq!(check("1000:7").unwrap(), user(1000, 7, &[50]));
        assert_eq!(check("app:staff").unwrap(), user(1000, 50, &[50]));
        assert_eq!(check("4242").unwrap(), user(4242, 0, &[]));
        assert!(check("nobody-here").unwrap_err().contains("nobody-here"));
        assert!(check("app:nogroup").unwrap_err().contains("nogroup"));
    }

    #[test]
    fn accounts_carry_the_name_and_home_of_their_entry() {
        let acct = |u: &str| account(u, || PASSWD.to_string(), || GROUP.to_string()).unwrap();
        let name = |a: Account| a.name;
        let home = |a: Account| a.home;
        assert_eq!(name(acct("")), "root");
        assert_eq!(home(acct("")), "/root");
        assert_eq!(name(acct("1000:7")), "app");
        assert_eq!(home(acct("app")), "/home/app");
        // A uid without an entry: named by its number, at home in `/`.
        assert_eq!(name(acct("4242")), "4242");
        assert_eq!(home(acct("4242")), "/");
        // Root without an entry is at home in /root, as under Docker.
        let bare = account("0", String::new, String::new).unwrap();
        assert_eq!((bare.name.as_str(), bare.home.as_str()), ("root", "/root"));
    }
}
