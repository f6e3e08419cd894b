//! Task uids: a range of uids the agent owns (`--task-uid-range`, default
//! 200000-299999), one of which each task gets for its life when the job's
//! user has no account on the node, like systemd's `DynamicUser=`. No two
//! running tasks share one; a uid goes back only once every process that
//! ran as it is gone, and the next one is taken round-robin (the cursor is
//! kept in the state directory), so a uid is reused as late as possible and
//! files a task left in a shared directory are not the next task's.
//!
//! A task's group is its user's: the server numbers users once, for good,
//! and the task runs in gid FIRST+N of the same range, with umask 007, so
//! every run of the user's jobs, on any node, may read and write what the
//! earlier ones left (a job's next attempt appends to its checkpoint) while
//! other tenants' tasks, in other groups, may not. A task whose user has
//! no number (a server before them) runs in `nogroup` with umask 077.
//!
//! The range is checked at the agent's start: no account or group of
//! `/etc/passwd` and `/etc/group` may have an id in it (a task could then
//! act as that account).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The default range: far above the ids distributions give accounts
/// (below 60000) and systemd's dynamic users (61184-65519), and below
/// container user namespaces' usual 100000-165535 only in that it starts
/// past them.
pub const DEFAULT_TASK_UID_RANGE: &str = "200000-299999";

/// An inclusive range of uids, at least one long, never reaching 0 or the
/// overflow uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    first: u32,
    last: u32,
}

impl UidRange {
    /// `FIRST-LAST`, e.g. `200000-299999`.
    pub fn parse(text: &str) -> Result<UidRange, String> {
        let (first, last) = text.trim().split_once('-').ok_or_else(|| {
            format!("`{text}` is not a uid range; write FIRST-LAST, e.g. {DEFAULT_TASK_UID_RANGE}")
        })?;
        let number = |part: &str| {
            part.trim().parse::<u32>().map_err(|_| {
                format!(
                    "`{part}` in `{text}` is not a uid; write FIRST-LAST, e.g. \
                     {DEFAULT_TASK_UID_RANGE}"
                )
            })
        };
        let (first, last) = (number(first)?, number(last)?);
        UidRange::new(first, last)
    }

    pub fn new(first: u32, last: u32) -> Result<UidRange, String> {
        if first == 0 || first > last {
            return Err(format!(
                "the uid range {first}-{last} is empty or holds root; give FIRST-LAST with \
                 0 < FIRST <= LAST"
            ));
        }
        // 65534 is nobody and the kernel's overflow id; u32::MAX is -1
        // (no change) to setuid.
        if (first..=last).contains(&65534) || last == u32::MAX {
            return Err(format!(
                "the uid range {first}-{last} holds 65534 (nobody, the overflow uid) or \
                 4294967295; choose one above them, e.g. {DEFAULT_TASK_UID_RANGE}"
            ));
        }
        Ok(UidRange { first, last })
    }

    pub fn first(&self) -> u32 {
        self.first
    }

    pub fn last(&self) -> u32 {
        self.last
    }

    pub fn len(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }

    /// The gid of user group `number` (the server's, the same on every
    /// node): FIRST+N, the range's ids doubling as gids (no group of the
    /// host has one, as [`check_free`] makes sure). `None` past the range.
    pub fn group(&self, number: u32) -> Option<u32> {
        let gid = self.first.checked_add(number)?;
        self.contains(gid).then_some(gid)
    }
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// The accounts (`/etc/passwd`) and groups (`/etc/group`) whose ids fall in
/// `range`, as `kind name id` lines: the range is not free while any is.
pub fn accounts_in(range: UidRange, passwd: &str, group: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (kind, text) in [("user", passwd), ("group", group)] {
        for line in text.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if line.starts_with('#') || fields.len() < 3 {
                continue;
            }
            if let Ok(id) = fields[2].parse::<u32>()
                && range.contains(id)
            {
                found.push(format!("{kind} {} ({id})", fields[0]));
            }
        }
    }
    found
}

/// Checks that no account or group of this host has an id in `range`.
pub fn check_free(range: UidRange) -> Result<(), String> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let taken = accounts_in(range, &read("/etc/passwd"), &read("/etc/group"));
    if taken.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the task uid range {range} is not free on this host: {} {} in it; choose a range no \
         account uses with --task-uid-range FIRST-LAST",
        taken.join(", "),
        if taken.len() == 1 { "is" } else { "are" }
    ))
}

/// The uids of this host's live processes, from the owners of
/// `/proc/PID` (the process's effective uid).
pub fn uids_running() -> BTreeSet<u32> {
    use std::os::unix::fs::MetadataExt;
    let mut uids = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return uids;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            continue;
        }
        if let Ok(metadata) = entry.metadata() {
            uids.insert(metadata.uid());
        }
    }
    uids
}

/// Which uid of the range each running task holds.
#[derive(Debug)]
pub struct UidPool {
    range: UidRange,
    /// uid → the task (allocation key) that holds it.
    held: BTreeMap<u32, String>,
    /// The next uid to try.
    cursor: u32,
    /// Where the cursor is kept across restarts.
    cursor_file: Option<PathBuf>,
}

impl UidPool {
    /// A pool over `range`, its cursor read from `cursor_file` (if any).
    pub fn new(range: UidRange, cursor_file: Option<PathBuf>) -> UidPool {
        let cursor = cursor_file
            .as_deref()
            .and_then(|path| std::fs::read_to_string(path).ok())
            .and_then(|text| text.trim().parse::<u32>().ok())
            .filter(|uid| range.contains(*uid))
            .unwrap_or(range.first);
        UidPool {
            range,
            held: BTreeMap::new(),
            cursor,
            cursor_file,
        }
    }

    pub fn range(&self) -> UidRange {
        self.range
    }

    /// Records that `key` holds `uid` (a task found running at start).
    pub fn hold(&mut self, uid: u32, key: &str) {
        if self.range.contains(uid) {
            self.held.insert(uid, key.to_string());
        }
    }

    /// The uid `key` holds, if any.
    pub fn held_by(&self, key: &str) -> Option<u32> {
        self.held
            .iter()
            .find_map(|(uid, holder)| (holder == key).then_some(*uid))
    }

    /// Gives `key`'s uid back (its task and every process of it are gone).
    pub fn release(&mut self, key: &str) {
        self.held.retain(|_, holder| holder != key);
    }

    /// A uid for `key`: the next one from the cursor that no task holds and
    /// no process of `running` has. `None` when every uid of the range is
    /// taken.
    pub fn allocate(&mut self, key: &str, running: &BTreeSet<u32>) -> Option<u32> {
        if let Some(uid) = self.held_by(key) {
            return Some(uid);
        }
        let uid = choose(self.range, self.cursor, |uid| {
            !self.held.contains_key(&uid) && !running.contains(&uid)
        })?;
        self.held.insert(uid, key.to_string());
        self.cursor = if uid == self.range.last {
            self.range.first
        } else {
            uid + 1
        };
        if let Some(path) = &self.cursor_file {
            // Losing the cursor only makes reuse earlier, never shared.
            let _ = write_cursor(path, self.cursor);
        }
        Some(uid)
    }
}

/// The first uid of `range` from `cursor` on (wrapping round) that is
/// `free`.
fn choose(range: UidRange, cursor: u32, free: impl Fn(u32) -> bool) -> Option<u32> {
    (cursor..=range.last)
        .chain(range.first..cursor)
        .find(|uid| free(*uid))
}

/// Written in place (one write of at most 11 bytes, the file's length set
/// after): no new file at each start. A torn write only loses the cursor.
fn write_cursor(path: &Path, cursor: u32) -> std::io::Result<()> {
    use std::io::Write;
    let text = format!("{cursor}\n");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    file.write_all(text.as_bytes())?;
    file.set_len(text.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_refuse_root_nobody_and_nonsense() {
        assert_eq!(
            UidRange::parse("200000-299999").unwrap(),
            UidRange {
                first: 200_000,
                last: 299_999
            }
        );
        assert_eq!(UidRange::parse("7-7").unwrap().len(), 1);
        // A user group's gid: within the range, never past it.
        let range = UidRange::parse("200000-200009").unwrap();
        assert_eq!(range.group(0), Some(200_000));
        assert_eq!(range.group(9), Some(200_009));
        assert_eq!(range.group(10), None);
        assert_eq!(range.group(u32::MAX), None);
        for bad in [
            "",
            "200000",
            "0-10",
            "10-5",
            "a-b",
            "60000-70000",
            "1-4294967295",
        ] {
            let error = UidRange::parse(bad).unwrap_err();
            assert!(
                error.contains("FIRST-LAST") || error.contains("choose"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn accounts_and_groups_in_the_range_are_found() {
        let range = UidRange::parse("1000-1999").unwrap();
        let passwd = "root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n\
                      # comment:x:1500\nbroken\n";
        let group = "root:x:0:\nstaff:x:50:\nteam:x:1999:alice\n";
        assert_eq!(
            accounts_in(range, passwd, group),
            vec!["user alice (1000)", "group team (1999)"]
        );
        assert!(accounts_in(UidRange::parse("200000-299999").unwrap(), passwd, group).is_empty());
    }

    #[test]
    fn no_two_tasks_share_a_uid_and_a_uid_comes_back_only_when_its_processes_are_gone() {
        let range = UidRange::parse("100-102").unwrap();
        let mut pool = UidPool::new(range, None);
        let none = BTreeSet::new();
        assert_eq!(pool.allocate("a", &none), Some(100));
        assert_eq!(pool.allocate("a", &none), Some(100), "a task keeps its uid");
        // 101 has a process of a task that ended: skipped.
        let running = BTreeSet::from([101]);
        assert_eq!(pool.allocate("b", &running), Some(102));
        assert_eq!(pool.allocate("c", &running), None, "every uid is taken");
        pool.release("a");
        // Round-robin: after 102 comes 100 again (101 still has a process).
        assert_eq!(pool.allocate("c", &running), Some(100));
        assert_eq!(pool.held_by("b"), Some(102));
        pool.release("b");
        assert_eq!(pool.held_by("b"), None);
        assert_eq!(pool.allocate("d", &none), Some(101));
        // A uid held at start (a task still running) is never handed out.
        let mut pool = UidPool::new(range, None);
        pool.hold(100, "old");
        pool.hold(7, "outside the range: ignored");
        assert_eq!(pool.allocate("new", &none), Some(101));
    }

    #[test]
    fn the_cursor_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("uid_cursor");
        let range = UidRange::parse("100-199").unwrap();
        let mut pool = UidPool::new(range, Some(file.clone()));
        assert_eq!(pool.allocate("a", &BTreeSet::new()), Some(100));
        assert_eq!(pool.allocate("b", &BTreeSet::new()), Some(101));
        let mut again = UidPool::new(range, Some(file.clone()));
        assert_eq!(again.allocate("c", &BTreeSet::new()), Some(102));
        // A cursor outside the range (the range changed) starts at its first.
        std::fs::write(&file, "5\n").unwrap();
        let mut changed = UidPool::new(range, Some(file));
        assert_eq!(changed.allocate("d", &BTreeSet::new()), Some(100));
    }
}
