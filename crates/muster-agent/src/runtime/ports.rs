//! The ports a task was given (its `MUSTER_MASTER_PORT` on the rank that
//! listens on it, a service replica's or dev environment's `PORT`) must be
//! free when it starts: on the host network a neighbour could take one
//! first, and the task would die later with `Address already in use`. A
//! start whose port is taken fails at once, saying which port and who holds
//! it (the job, when the holder is a muster task).

use std::collections::BTreeMap;

/// The ports of a task's environment it will listen on: `PORT`, and
/// `MUSTER_MASTER_PORT` on rank 0 (the rendezvous' host), with the
/// variable that names each.
pub fn listening_ports(env: &BTreeMap<String, String>) -> Vec<(&'static str, u16)> {
    let mut ports = Vec::new();
    let rank0 = env
        .get("MUSTER_NODE_RANK")
        .is_none_or(|rank| rank.trim() == "0");
    if rank0
        && let Some(port) = env
            .get("MUSTER_MASTER_PORT")
            .and_then(|p| p.trim().parse().ok())
    {
        ports.push(("MUSTER_MASTER_PORT", port));
    }
    if let Some(port) = env.get("PORT").and_then(|p| p.trim().parse::<u16>().ok())
        && !ports.iter().any(|(_, p)| *p == port)
    {
        ports.push(("PORT", port));
    }
    ports.retain(|(_, port)| *port != 0);
    ports
}

/// Whether `port` can be listened on (every address, as a task on the host
/// network would).
pub fn is_free(port: u16) -> bool {
    // std sets SO_REUSEADDR: a port in TIME_WAIT from a task that ended is
    // free, one with a listener (on any address) is not.
    std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
}

/// The socket inodes listening on `port` in a `/proc/net/tcp` or `tcp6`
/// table.
pub fn listening_inodes(table: &str, port: u16) -> Vec<u64> {
    listeners(table, port)
        .into_iter()
        .map(|(inode, _)| inode)
        .collect()
}

/// The listening sockets on `port` in a `/proc/net/tcp` or `tcp6` table:
/// (inode, the address it is bound to).
pub fn listeners(table: &str, port: u16) -> Vec<(u64, std::net::IpAddr)> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (hex_address, hex_port) = fields.get(1)?.rsplit_once(':')?;
            let inode = fields.get(9)?.parse::<u64>().ok()?;
            let local_port = u16::from_str_radix(hex_port, 16).ok()?;
            if local_port != port || *fields.get(3)? != "0A" {
                return None;
            }
            Some((inode, kernel_address(hex_address)?))
        })
        .collect()
}

/// An address as the kernel's tables print it: 32-bit words in hex, each
/// in the machine's byte order.
fn kernel_address(hex: &str) -> Option<std::net::IpAddr> {
    let mut bytes = Vec::with_capacity(16);
    for word in hex.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(word).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    match bytes.len() {
        4 => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => Some(std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => None,
    }
}

/// The most file descriptors [`task_listener`] looks at for one check.
const MOST_SEARCHED: usize = 65_536;

/// Where a replica's own listener on `port` is reached: the address its
/// socket is bound to (loopback for a wildcard), found only when a
/// process of the task holds that socket. `members`: the task's pids
/// (its cgroup's); without them (no cgroup, a container) the processes
/// whose environment names the job (`MUSTER_JOB_ID`). Anything else on
/// the port (another tenant's task, the server, a daemon of the node) is
/// an error, and no connection is made: a check is never a port scanner.
pub fn task_listener(
    port: u16,
    members: Option<&[i32]>,
    job: u64,
) -> Result<std::net::SocketAddr, String> {
    let mut sockets = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            sockets.extend(listeners(&text, port));
        }
    }
    let not_sent = |why: &str| {
        format!(
            "port {port}: {why}; the check was not sent (a check reaches only its replica's own listener)"
        )
    };
    if sockets.is_empty() {
        return Err(not_sent("nothing listens there"));
    }
    // A task decides how many processes and descriptors it has: the search
    // stops after MOST_SEARCHED descriptors in all (then: not sent).
    let searched = std::cell::Cell::new(0usize);
    let holds = |pid: i32| -> Option<std::net::IpAddr> {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
        fds.flatten()
            .take_while(|_| {
                searched.set(searched.get() + 1);
                searched.get() <= MOST_SEARCHED
            })
            .find_map(|fd| {
                let target = std::fs::read_link(fd.path()).ok()?;
                let inode: u64 = target
                    .to_str()?
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse()
                    .ok()?;
                sockets
                    .iter()
                    .find(|(listening, _)| *listening == inode)
                    .map(|(_, address)| *address)
            })
    };
    let found = match members.filter(|members| !members.is_empty()) {
        Some(members) => members.iter().find_map(|&pid| holds(pid)),
        None => {
            let wanted = format!("MUSTER_JOB_ID={job}");
            std::fs::read_dir("/proc")
                .map_err(|error| not_sent(&format!("/proc cannot be read ({error})")))?
                .flatten()
                .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
                .filter(|pid| {
                    std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| {
                        environ
                            .split(|byte| *byte == 0)
                            .any(|var| var == wanted.as_bytes())
                    })
                })
                .find_map(holds)
        }
    };
    if found.is_none() && searched.get() > MOST_SEARCHED {
        return Err(not_sent(&format!(
            "its task holds more than {MOST_SEARCHED} descriptors, too many to search for its \
             listener"
        )));
    }
    let address = found.ok_or_else(|| not_sent("it is not held by this replica's task"))?;
    let address = match address {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        address => address,
    };
    Ok(std::net::SocketAddr::new(address, port))
}

/// Who listens on `port`: a sentence naming the process, and its muster
/// job when it is a task's.
pub fn holder_of(port: u16) -> Option<String> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            inodes.extend(listening_inodes(&text, port));
        }
    }
    if inodes.is_empty() {
        return None;
    }
    let wanted: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|target| wanted.iter().any(|w| target.as_os_str() == w.as_str()))
        });
        if !holds {
            continue;
        }
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let job = environ
            .split(|b| *b == 0)
            .find_map(|var| var.strip_prefix(b"MUSTER_JOB_ID="))
            .map(|id| String::from_utf8_lossy(id).into_owned());
        let command = std::fs::read(entry.path().join("comm"))
            .map(|c| String::from_utf8_lossy(&c).trim().to_string())
            .unwrap_or_default();
        return Some(match job {
            Some(job) => format!("job {job}'s task (pid {pid}, {command})"),
            None => format!("pid {pid} ({command}), not a muster task"),
        });
    }
    Some("a process this agent cannot see".to_string())
}

/// Checks that every port the task will listen on is free: the error says
/// which is taken and by whom.
pub fn check_free(env: &BTreeMap<String, String>) -> Result<(), String> {
    for (variable, port) in listening_ports(env) {
        if !is_free(port) {
            let holder = holder_of(port).unwrap_or_else(|| "another process".to_string());
            return Err(format!(
                "port {port}, the task's {variable}, is already taken by {holder}; the task \
                 would fail to listen on it. Free the port (or move the server's \
                 --master-port-base away from ports the nodes use) and the job is started \
                 again"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn rank_zero_listens_on_the_master_port_and_a_replica_on_its_port() {
        assert_eq!(
            listening_ports(&env(&[
                ("MUSTER_MASTER_PORT", "29501"),
                ("MUSTER_NODE_RANK", "0")
            ])),
            vec![("MUSTER_MASTER_PORT", 29501)]
        );
        assert!(
            listening_ports(&env(&[
                ("MUSTER_MASTER_PORT", "29501"),
                ("MUSTER_NODE_RANK", "1")
            ]))
            .is_empty()
        );
        assert_eq!(
            listening_ports(&env(&[("MUSTER_MASTER_PORT", "29501"), ("PORT", "29501")])),
            vec![("MUSTER_MASTER_PORT", 29501)]
        );
        assert_eq!(
            listening_ports(&env(&[("PORT", "8080"), ("MUSTER_NODE_RANK", "2")])),
            vec![("PORT", 8080)]
        );
        assert!(listening_ports(&env(&[("PORT", "x")])).is_empty());
    }

    #[test]
    fn listeners_are_read_from_the_kernel_s_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:7531 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0\n\
   1: 0100007F:7531 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0000000000000000 100 0 0 10 0\n\
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(listening_inodes(table, 0x7531), vec![4242]);
        assert_eq!(listening_inodes(table, 22), vec![17]);
        assert!(listening_inodes(table, 80).is_empty());
    }

    #[test]
    fn a_listener_s_address_is_read_in_the_machine_s_byte_order() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 51 1 0000000000000000 100 0 0 10 0\n";
        let table6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 52 1 0000000000000000 100 0 0 10 0\n";
        if cfg!(target_endian = "little") {
            assert_eq!(
                listeners(table, 8080),
                vec![(51, std::net::Ipv4Addr::LOCALHOST.into())]
            );
            assert_eq!(
                listeners(table6, 8080),
                vec![(52, std::net::Ipv6Addr::LOCALHOST.into())]
            );
        }
        assert!(listeners(table, 8081).is_empty());
    }

    #[test]
    fn only_the_task_s_own_listener_is_reachable_by_its_checks() {
        // This test process holds the listener; a task whose pids or whose
        // job do not match gets no address (and nothing is sent).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let port = listener.local_addr().expect("an address").port();
        let me = std::process::id() as i32;
        assert_eq!(
            task_listener(port, Some(&[me]), 1),
            Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        );
        let error = task_listener(port, Some(&[i32::MAX]), 1).unwrap_err();
        assert!(error.contains("not held by this replica's task"), "{error}");
        assert!(error.contains("not sent"), "{error}");
        // No cgroup: by job, and this process names none.
        let error = task_listener(port, None, 987_654_321).unwrap_err();
        assert!(error.contains("not held"), "{error}");
        drop(listener);
        let error = task_listener(port, Some(&[me]), 1).unwrap_err();
        assert!(error.contains("nothing listens"), "{error}");
    }

    #[test]
    fn a_taken_port_is_refused_naming_its_holder() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let port = listener.local_addr().expect("an address").port();
        let taken = env(&[("PORT", &port.to_string())]);
        let error = check_free(&taken).unwrap_err();
        assert!(error.contains(&format!("port {port}")), "{error}");
        assert!(
            error.contains(&format!("pid {}", std::process::id())),
            "{error}"
        );
        drop(listener);
        assert!(check_free(&taken).is_ok());
    }
}
