//! Control groups: one per task, so that a stop, a fence or the end of a task
//! reaches every process it started (`setsid`, double forks and all), and so
//! that its memory can be limited and its use measured.
//!
//! Three kinds, chosen once at agent start ([`detect`]) and written into each
//! task's record, so the supervisor and a restarted agent use the same:
//! - cgroup v2 (`cgroup.kill` to kill, `memory.max` as the limit, `cpu.stat`
//!   and `memory.peak` for accounting), where the host mounts a v2 hierarchy
//!   with the memory controller (or where the operator names one);
//! - cgroup v1 (`freezer` to kill atomically: freeze, kill every member,
//!   thaw; `memory` for the limit and peak, `cpuacct` and `pids`), where the
//!   host has only that, as the machines this project builds on do;
//! - none: process groups plus the supervisor as child subreaper, which
//!   still catches descendants that leave the task's process group.
//!
//! Everything here is plain file writes under directories given as values,
//! so the logic is tested against a temporary directory as well as against
//! the host's real hierarchies.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What the operator asked for (`muster agent --cgroups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CgroupChoice {
    /// v2 where usable, else v1, else none.
    #[default]
    Auto,
    V2,
    V1,
    None,
}

impl CgroupChoice {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(Self::Auto),
            "v2" => Some(Self::V2),
            "v1" => Some(Self::V1),
            "none" => Some(Self::None),
            _ => None,
        }
    }
}

/// Where a node's task cgroups live: the parent directories, one per
/// hierarchy, under which each task gets a directory named after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CgroupPlan {
    V2 {
        parent: PathBuf,
        /// The memory controller is enabled below `parent` (limits hold).
        memory: bool,
    },
    V1 {
        freezer: PathBuf,
        memory: Option<PathBuf>,
        cpuacct: Option<PathBuf>,
        pids: Option<PathBuf>,
    },
    None,
}

impl CgroupPlan {
    /// One line for the agent's start message.
    pub fn describe(&self) -> String {
        match self {
            CgroupPlan::V2 { parent, memory } => format!(
                "cgroup v2 under {} (cgroup.kill{})",
                parent.display(),
                if *memory {
                    ", memory limits"
                } else {
                    "; no memory controller there, so memory limits are not enforced"
                }
            ),
            CgroupPlan::V1 {
                freezer,
                memory,
                cpuacct,
                pids,
            } => {
                let mut used = vec![format!("freezer {}", freezer.display())];
                for (name, path) in [("memory", memory), ("cpuacct", cpuacct), ("pids", pids)] {
                    if let Some(path) = path {
                        used.push(format!("{name} {}", path.display()));
                    }
                }
                let mut text = format!("cgroup v1 ({})", used.join(", "));
                if memory.is_none() {
                    text.push_str("; no memory hierarchy, so memory limits are not enforced");
                }
                text
            }
            CgroupPlan::None => "no cgroups: process groups and a child subreaper per task \
                                 (no memory limits; a task can still be found through its \
                                 supervisor)"
                .to_string(),
        }
    }

    /// Removes this agent's own parent directories, when no task cgroup is
    /// left in them (a task still running keeps them: `rmdir` refuses), so
    /// an agent that stops leaves nothing behind in the hierarchies. The
    /// shared `muster` directory above them stays.
    pub fn remove_parents(&self) {
        let parents: Vec<&PathBuf> = match self {
            CgroupPlan::V2 { parent, .. } => vec![parent],
            CgroupPlan::V1 {
                freezer,
                memory,
                cpuacct,
                pids,
            } => std::iter::once(freezer)
                .chain([memory, cpuacct, pids].into_iter().flatten())
                .collect(),
            CgroupPlan::None => Vec::new(),
        };
        for parent in parents {
            let _ = std::fs::remove_dir(parent);
        }
    }

    /// The task's cgroup under this plan.
    pub fn task(&self, key: &str) -> TaskCgroup {
        match self {
            CgroupPlan::V2 { parent, memory } => TaskCgroup::V2 {
                dir: parent.join(key),
                memory: *memory,
            },
            CgroupPlan::V1 {
                freezer,
                memory,
                cpuacct,
                pids,
            } => TaskCgroup::V1 {
                freezer: freezer.join(key),
                memory: memory.as_ref().map(|p| p.join(key)),
                cpuacct: cpuacct.as_ref().map(|p| p.join(key)),
                pids: pids.as_ref().map(|p| p.join(key)),
            },
            CgroupPlan::None => TaskCgroup::None,
        }
    }
}

/// The cgroup directories of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskCgroup {
    V2 {
        dir: PathBuf,
        memory: bool,
    },
    V1 {
        freezer: PathBuf,
        memory: Option<PathBuf>,
        cpuacct: Option<PathBuf>,
        pids: Option<PathBuf>,
    },
    None,
}

/// A task's limits, set when its cgroup is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    /// Processes and threads at once.
    pub pids: Option<u64>,
}

/// What a task used, read when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub cpu_ms: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    /// The kernel's OOM killer ended a process of the task because of its
    /// memory limit.
    pub oom_killed: bool,
}

fn io_error(path: &Path, error: std::io::Error) -> String {
    format!("{}: {error}", path.display())
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| io_error(path, e))
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// The value of `key` in a flat keyed file (`memory.events`, `cpu.stat`,
/// `memory.oom_control`): lines of `key value`.
pub fn keyed_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok())?
    })
}

impl TaskCgroup {
    /// Every directory of the task's cgroup.
    fn dirs(&self) -> Vec<&Path> {
        match self {
            TaskCgroup::V2 { dir, .. } => vec![dir],
            TaskCgroup::V1 {
                freezer,
                memory,
                cpuacct,
                pids,
            } => {
                let mut dirs = vec![freezer.as_path()];
                dirs.extend(
                    [memory, cpuacct, pids]
                        .into_iter()
                        .flatten()
                        .map(PathBuf::as_path),
                );
                dirs
            }
            TaskCgroup::None => Vec::new(),
        }
    }

    /// Creates the directories (an existing, empty one from a task that ran
    /// before under the same name is reused) and sets the limits: the
    /// memory limit, and the most processes and threads the task may have
    /// at once (where the node has a pids controller), so that a fork bomb
    /// starves neither its neighbours nor the agent.
    pub fn create(&self, limits: Limits) -> Result<(), String> {
        for dir in self.dirs() {
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(error) => return Err(io_error(dir, error)),
            }
        }
        if let Some(most) = limits.pids {
            let pids_max = match self {
                TaskCgroup::V2 { dir, .. } => Some(dir.join("pids.max")),
                TaskCgroup::V1 { pids, .. } => pids.as_ref().map(|dir| dir.join("pids.max")),
                TaskCgroup::None => None,
            };
            if let Some(path) = pids_max.filter(|path| path.exists()) {
                write(&path, &most.to_string())?;
            }
        }
        let Some(limit) = limits.memory_bytes else {
            return Ok(());
        };
        match self {
            TaskCgroup::V2 { dir, memory: true } => {
                write(&dir.join("memory.max"), &limit.to_string())?;
                // No swap: the limit is the task's memory, as the scheduler
                // counted it.
                let _ = write(&dir.join("memory.swap.max"), "0");
            }
            TaskCgroup::V1 {
                memory: Some(dir), ..
            } => {
                write(&dir.join("memory.limit_in_bytes"), &limit.to_string())?;
                let _ = write(&dir.join("memory.memsw.limit_in_bytes"), &limit.to_string());
            }
            _ => {}
        }
        Ok(())
    }

    /// The `cgroup.procs` files a new task must write its pid into, in
    /// order (open them before forking, write in the child).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .map(|dir| dir.join("cgroup.procs"))
            .collect()
    }

    /// The pids in the task's cgroup (the freezer's in v1), or `None` with
    /// no cgroup (or when it cannot be read).
    pub fn members(&self) -> Option<Vec<i32>> {
        let procs = match self {
            TaskCgroup::V2 { dir, .. } => dir.join("cgroup.procs"),
            TaskCgroup::V1 { freezer, .. } => freezer.join("cgroup.procs"),
            TaskCgroup::None => return None,
        };
        let text = read(&procs)?;
        Some(
            text.lines()
                .filter_map(|line| line.trim().parse().ok())
                .collect(),
        )
    }

    /// Kills every process of the task, atomically where the kernel allows
    /// (v2 `cgroup.kill`; v1 freeze, kill, thaw), and waits up to `limit`
    /// for the cgroup to be empty. `true` when it is (or there is none).
    pub fn kill_all(&self, limit: Duration) -> bool {
        let started = Instant::now();
        loop {
            match self {
                TaskCgroup::V2 { dir, .. } => {
                    let kill = dir.join("cgroup.kill");
                    if write(&kill, "1").is_err() {
                        // Kernels before 5.14: kill the members one by one.
                        self.kill_members();
                    }
                }
                TaskCgroup::V1 { freezer, .. } => {
                    let state = freezer.join("freezer.state");
                    let frozen = write(&state, "FROZEN").is_ok() && {
                        let until = Instant::now() + Duration::from_millis(500);
                        loop {
                            if read(&state).is_some_and(|s| s.trim() == "FROZEN") {
                                break true;
                            }
                            if Instant::now() >= until {
                                break false;
                            }
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    };
                    self.kill_members();
                    let _ = write(&state, "THAWED");
                    let _ = frozen;
                }
                TaskCgroup::None => return true,
            }
            let until = (Instant::now() + Duration::from_millis(200)).min(started + limit);
            loop {
                if self.members().is_none_or(|m| m.is_empty()) {
                    return true;
                }
                if Instant::now() >= until {
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            if started.elapsed() >= limit {
                return false;
            }
        }
    }

    fn kill_members(&self) {
        for pid in self.members().unwrap_or_default() {
            if pid > 1 {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }

    /// Sends `signal` to every process of the task.
    pub fn signal_all(&self, signal: nix::sys::signal::Signal) {
        for pid in self.members().unwrap_or_default() {
            if pid > 1 {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
            }
        }
    }

    /// What the task used; read before [`remove`](Self::remove).
    pub fn usage(&self) -> Usage {
        match self {
            TaskCgroup::V2 { dir, .. } => Usage {
                cpu_ms: read(&dir.join("cpu.stat"))
                    .and_then(|t| keyed_value(&t, "usage_usec"))
                    .map(|us| us / 1000),
                memory_peak_bytes: read(&dir.join("memory.peak"))
                    .and_then(|t| t.trim().parse().ok()),
                oom_killed: read(&dir.join("memory.events"))
                    .and_then(|t| keyed_value(&t, "oom_kill"))
                    .is_some_and(|n| n > 0),
            },
            TaskCgroup::V1 {
                memory, cpuacct, ..
            } => Usage {
                cpu_ms: cpuacct
                    .as_ref()
                    .and_then(|dir| read(&dir.join("cpuacct.usage")))
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .map(|ns| ns / 1_000_000),
                memory_peak_bytes: memory
                    .as_ref()
                    .and_then(|dir| read(&dir.join("memory.max_usage_in_bytes")))
                    .and_then(|t| t.trim().parse().ok()),
                oom_killed: memory
                    .as_ref()
                    .and_then(|dir| read(&dir.join("memory.oom_control")))
                    .and_then(|t| keyed_value(&t, "oom_kill"))
                    .is_some_and(|n| n > 0),
            },
            TaskCgroup::None => Usage::default(),
        }
    }

    /// Removes the (empty) directories; a directory already gone is fine.
    pub fn remove(&self) -> Result<(), String> {
        let mut failed = Vec::new();
        for dir in self.dirs() {
            // A just-killed cgroup can stay busy for a moment.
            let mut tries = 0;
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => break,
                    Err(error) if tries < 50 => {
                        let _ = error;
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(error) => {
                        failed.push(io_error(dir, error));
                        break;
                    }
                }
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(failed.join("; "))
        }
    }
}

/// A cgroup mount from `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub point: PathBuf,
    /// `cgroup2`, or `cgroup` for v1.
    pub version2: bool,
    /// v1: the controllers of this hierarchy (from its options).
    pub controllers: Vec<String>,
}

/// The cgroup mounts listed in a `mountinfo` text.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    const V1_CONTROLLERS: &[&str] = &[
        "freezer", "memory", "cpuacct", "pids", "cpu", "cpuset", "devices", "blkio",
    ];
    let mut mounts = Vec::new();
    for line in text.lines() {
        let Some((before, after)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = before.split_whitespace().nth(4) else {
            continue;
        };
        let mut after = after.split_whitespace();
        let fstype = after.next().unwrap_or_default();
        let _source = after.next();
        let options = after.next().unwrap_or_default();
        let version2 = match fstype {
            "cgroup2" => true,
            "cgroup" => false,
            _ => continue,
        };
        let controllers = if version2 {
            Vec::new()
        } else {
            options
                .split(',')
                .filter(|o| V1_CONTROLLERS.contains(o))
                .map(str::to_string)
                .collect()
        };
        // mountinfo escapes spaces and the like as octal.
        let point = point.replace("\\040", " ");
        mounts.push(Mount {
            point: PathBuf::from(point),
            version2,
            controllers,
        });
    }
    mounts
}

/// A directory name for the node's cgroups: its name with anything but
/// letters, digits, `-`, `_` and `.` replaced.
pub fn node_dir_name(node: &str) -> String {
    let name: String = node
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() || name.starts_with('.') {
        format!("n{name}")
    } else {
        name
    }
}

/// The directory of one agent's task cgroups: its node name and a hash of
/// its state directory, so two agents on one host (tests, or a node
/// re-registered under another state directory) never share task cgroups
/// (task names repeat across clusters), while a restarted agent finds its
/// own again.
pub fn agent_dir_name(node: &str, state_dir: &Path) -> String {
    // FNV-1a, 32 bits: stable across builds and platforms.
    let mut hash: u32 = 0x811c_9dc5;
    for byte in state_dir.as_os_str().as_encoded_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    format!("{}-{hash:08x}", node_dir_name(node))
}

/// Tries to set up a plan of the given version under `mounts`, creating the
/// node's parent directories and a probe task cgroup (removed again).
fn try_v2(mount: &Path, node: &str) -> Result<CgroupPlan, String> {
    let controllers = read(&mount.join("cgroup.controllers"))
        .ok_or_else(|| format!("{} is not a cgroup v2 hierarchy", mount.display()))?;
    let available: Vec<&str> = controllers.split_whitespace().collect();
    let wanted: Vec<&str> = ["memory", "pids", "cpu"]
        .into_iter()
        .filter(|c| available.contains(c))
        .collect();
    let enable = wanted
        .iter()
        .map(|c| format!("+{c}"))
        .collect::<Vec<_>>()
        .join(" ");
    let muster = mount.join("muster");
    let parent = muster.join(node_dir_name(node));
    for dir in [&muster, &parent] {
        match std::fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_error(dir, e)),
        }
    }
    let mut memory = false;
    if !enable.is_empty() {
        // Enabled level by level; a level that refuses (delegation, or
        // processes in it) leaves the limits off, not the cgroups.
        let ok = [mount, muster.as_path(), parent.as_path()]
            .iter()
            .all(|dir| write(&dir.join("cgroup.subtree_control"), &enable).is_ok());
        memory = ok && wanted.contains(&"memory");
    }
    let plan = CgroupPlan::V2 { parent, memory };
    probe(&plan)?;
    Ok(plan)
}

fn try_v1(mounts: &[Mount], node: &str) -> Result<CgroupPlan, String> {
    let find = |name: &str| {
        mounts
            .iter()
            .find(|m| !m.version2 && m.controllers.iter().any(|c| c == name))
            .map(|m| m.point.clone())
    };
    let freezer = find("freezer").ok_or("no cgroup v1 freezer hierarchy is mounted")?;
    let parent_of = |root: PathBuf| -> Result<PathBuf, String> {
        let muster = root.join("muster");
        let parent = muster.join(node_dir_name(node));
        for dir in [&muster, &parent] {
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_error(dir, e)),
            }
        }
        Ok(parent)
    };
    let freezer = parent_of(freezer)?;
    // Optional hierarchies: one that cannot be used is left out.
    let optional = |name: &str| find(name).and_then(|root| parent_of(root).ok());
    let memory = optional("memory");
    if let Some(memory) = &memory {
        let _ = write(&memory.join("memory.use_hierarchy"), "1");
    }
    let plan = CgroupPlan::V1 {
        freezer,
        memory,
        cpuacct: optional("cpuacct"),
        pids: optional("pids"),
    };
    probe(&plan)?;
    Ok(plan)
}

/// Creates and removes a task cgroup, to find out now rather than at the
/// first task that the plan works.
fn probe(plan: &CgroupPlan) -> Result<(), String> {
    let cgroup = plan.task("muster-probe");
    cgroup.create(Limits::default())?;
    cgroup.remove()
}

/// The plan for `choice` on this host, and why the kinds before it were not
/// used (for the start message). Task cgroups go under `muster/NAME` in each
/// hierarchy (see [`agent_dir_name`]). `v2_root` overrides where the v2
/// hierarchy is (by default the first `cgroup2` mount).
pub fn detect(
    choice: CgroupChoice,
    node: &str,
    v2_root: Option<&Path>,
) -> Result<(CgroupPlan, Vec<String>), String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mounts = parse_mountinfo(&mountinfo);
    let v2_mount = v2_root
        .map(Path::to_path_buf)
        .or_else(|| mounts.iter().find(|m| m.version2).map(|m| m.point.clone()));
    let mut skipped = Vec::new();
    let v2 = || -> Result<CgroupPlan, String> {
        let mount = v2_mount
            .clone()
            .ok_or("no cgroup v2 hierarchy is mounted")?;
        try_v2(&mount, node)
    };
    match choice {
        CgroupChoice::V2 => v2().map(|plan| (plan, skipped)),
        CgroupChoice::V1 => try_v1(&mounts, node).map(|plan| (plan, skipped)),
        CgroupChoice::None => Ok((CgroupPlan::None, skipped)),
        CgroupChoice::Auto => {
            // v2 only where it carries the memory controller: a hybrid host's
            // empty v2 hierarchy would give no limits while v1 does.
            match v2() {
                Ok(plan @ CgroupPlan::V2 { memory: true, .. }) => return Ok((plan, skipped)),
                Ok(unused) => {
                    // Not used: leave nothing of it behind.
                    unused.remove_parents();
                    skipped.push("cgroup v2: no memory controller".to_string());
                }
                Err(why) => skipped.push(format!("cgroup v2: {why}")),
            }
            match try_v1(&mounts, node) {
                Ok(plan) => return Ok((plan, skipped)),
                Err(why) => skipped.push(format!("cgroup v1: {why}")),
            }
            Ok((CgroupPlan::None, skipped))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:23 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
27 25 0:25 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer
28 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
29 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
30 25 0:28 / /sys/fs/cgroup/my\\040pids rw - cgroup cgroup rw,pids
31 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
";

    #[test]
    fn reads_cgroup_mounts_of_both_versions() {
        let mounts = parse_mountinfo(HYBRID);
        assert_eq!(mounts.len(), 5);
        assert!(mounts[0].version2);
        assert_eq!(mounts[0].point, PathBuf::from("/sys/fs/cgroup/unified"));
        assert_eq!(mounts[2].controllers, vec!["cpu", "cpuacct"]);
        assert_eq!(mounts[4].point, PathBuf::from("/sys/fs/cgroup/my pids"));
        assert!(parse_mountinfo("garbage\n\n - \n").is_empty());
    }

    #[test]
    fn keyed_files_are_read_by_name() {
        let events = "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n";
        assert_eq!(keyed_value(events, "oom_kill"), Some(2));
        assert_eq!(keyed_value(events, "oom"), Some(1));
        assert_eq!(keyed_value(events, "missing"), None);
        assert_eq!(keyed_value("oom_kill x", "oom_kill"), None);
    }

    #[test]
    fn node_names_become_safe_directory_names() {
        assert_eq!(node_dir_name("gpu-01.dc"), "gpu-01.dc");
        assert_eq!(node_dir_name("../etc"), "n.._etc");
        assert_eq!(node_dir_name("a/b c"), "a_b_c");
        assert_eq!(node_dir_name(""), "n");
        let one = agent_dir_name("node-a", Path::new("/var/lib/muster/a"));
        assert!(
            one.starts_with("node-a-") && one.len() == "node-a-".len() + 8,
            "{one}"
        );
        assert_eq!(
            one,
            agent_dir_name("node-a", Path::new("/var/lib/muster/a"))
        );
        assert_ne!(one, agent_dir_name("node-a", Path::new("/tmp/other")));
    }

    /// The file writes of each kind, against a temporary directory standing
    /// in for the hierarchies (the kernel's own files are exercised by the
    /// end-to-end tests on the host).
    #[test]
    fn v2_writes_the_limit_and_reads_usage() {
        let root = tempfile::tempdir().unwrap();
        let plan = CgroupPlan::V2 {
            parent: root.path().to_path_buf(),
            memory: true,
        };
        let cgroup = plan.task("j1-a2-g3");
        cgroup
            .create(Limits {
                memory_bytes: Some(512 << 20),
                pids: Some(100),
            })
            .unwrap();
        let dir = root.path().join("j1-a2-g3");
        assert_eq!(
            std::fs::read_to_string(dir.join("memory.max")).unwrap(),
            (512u64 << 20).to_string()
        );
        std::fs::write(dir.join("cpu.stat"), "usage_usec 2500000\nuser_usec 1\n").unwrap();
        std::fs::write(dir.join("memory.peak"), "1048576\n").unwrap();
        std::fs::write(dir.join("memory.events"), "oom 1\noom_kill 1\n").unwrap();
        std::fs::write(dir.join("cgroup.procs"), "").unwrap();
        assert_eq!(
            cgroup.usage(),
            Usage {
                cpu_ms: Some(2500),
                memory_peak_bytes: Some(1 << 20),
                oom_killed: true
            }
        );
        assert_eq!(cgroup.members(), Some(vec![]));
        assert!(cgroup.kill_all(Duration::from_millis(50)));
        assert_eq!(
            std::fs::read_to_string(dir.join("cgroup.kill")).unwrap(),
            "1"
        );
        assert_eq!(cgroup.procs_files(), vec![dir.join("cgroup.procs")]);
    }

    #[test]
    fn v1_writes_the_limit_in_the_memory_hierarchy_and_freezes_to_kill() {
        let root = tempfile::tempdir().unwrap();
        let sub = |name: &str| {
            let path = root.path().join(name);
            std::fs::create_dir(&path).unwrap();
            path
        };
        let plan = CgroupPlan::V1 {
            freezer: sub("freezer"),
            memory: Some(sub("memory")),
            cpuacct: Some(sub("cpuacct")),
            pids: None,
        };
        let cgroup = plan.task("t");
        // The pids file exists only where the kernel made it: here, none.
        cgroup
            .create(Limits {
                memory_bytes: Some(1 << 30),
                pids: Some(100),
            })
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(root.path().join("memory/t/memory.limit_in_bytes")).unwrap(),
            (1u64 << 30).to_string()
        );
        std::fs::write(root.path().join("freezer/t/cgroup.procs"), "").unwrap();
        assert!(cgroup.kill_all(Duration::from_millis(600)));
        // Thawed again after the kill.
        assert_eq!(
            std::fs::read_to_string(root.path().join("freezer/t/freezer.state")).unwrap(),
            "THAWED"
        );
        std::fs::write(root.path().join("cpuacct/t/cpuacct.usage"), "3000000000\n").unwrap();
        std::fs::write(
            root.path().join("memory/t/memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
        )
        .unwrap();
        let usage = cgroup.usage();
        assert_eq!(usage.cpu_ms, Some(3000));
        assert!(!usage.oom_killed);
        assert_eq!(cgroup.procs_files().len(), 3);
        // Plain files in the temporary tree keep `remove_dir` from working:
        // it must say which directory it could not remove.
        let error = cgroup.remove().unwrap_err();
        assert!(error.contains("freezer/t"), "{error}");
    }

    #[test]
    fn no_cgroup_has_nothing_to_do() {
        let cgroup = CgroupPlan::None.task("t");
        cgroup
            .create(Limits {
                memory_bytes: Some(1),
                pids: Some(1),
            })
            .unwrap();
        assert_eq!(cgroup.members(), None);
        assert!(cgroup.kill_all(Duration::from_millis(1)));
        assert_eq!(cgroup.usage(), Usage::default());
        assert!(cgroup.remove().is_ok());
    }
}
