//! Task logs on the server's disk: exactly the bytes a task wrote, at the
//! offsets it wrote them, bounded per task.
//!
//! Offsets always count the task's own output. The limit is per job: each
//! of a job's `N` tasks gets `L = limit / N` bytes (at least
//! [`MIN_LOG_BYTES`]), and its log keeps:
//! - the head, the first `L / 2` bytes, in `logs/<allocation>.log`;
//! - the tail, the last bytes written, in at most two segment files
//!   `logs/<allocation>.tail/<first offset>` of up to `L / 4` bytes each:
//!   when the newest segment is full a new one starts and the oldest goes, so
//!   between `L / 4` and `L / 2` of the latest bytes stay;
//! - `logs/<allocation>.eof` once the agent said the output is whole.
//!
//! So at most `L` bytes are stored per task however long it writes. A
//! reader whose offset falls between the head and the tail gets the marker
//! `\n[muster: N bytes omitted]\n` and the offset of the tail's first byte.
//!
//! Reads and writes of one task's log are serialised (a lock per stripe of
//! allocations, [`LOCK_STRIPES`] of them), so a reader never opens a
//! segment that is being dropped; different tasks' logs mostly go in
//! parallel.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// Why a chunk was not stored.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error(
        "the chunk starts at byte {offset} but the log of allocation {allocation} ends at byte \
         {end}; send from byte {end}"
    )]
    Gap {
        allocation: u64,
        offset: u64,
        end: u64,
    },
    #[error(
        "the chunk of allocation {allocation} skips from byte {end} to {offset}, but only a log \
         whose first {head} bytes are stored may skip; send from byte {end}"
    )]
    EarlySkip {
        allocation: u64,
        offset: u64,
        end: u64,
        head: u64,
    },
    #[error("cannot {what} the log file {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The answer to a stored chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// Where the stored log ends (where the next chunk starts).
    pub end: u64,
    /// How many of the first bytes are kept.
    pub head_bytes: u64,
    /// How many of the latest bytes past the head are kept (at least half
    /// of this).
    pub tail_bytes: u64,
}

/// A read of a task's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRead {
    pub data: Vec<u8>,
    pub next_offset: u64,
    /// Where the stored log ends now.
    pub end: u64,
    /// The agent said the output is whole.
    pub eof: bool,
    /// When the log was last written (`None`: nothing was ever stored).
    pub modified: Option<SystemTime>,
}

/// Every task's log under one directory, with a size limit per job.
#[derive(Debug)]
pub struct LogStore {
    dir: PathBuf,
    limit: u64,
    locks: Vec<Mutex<()>>,
}

/// How one task's log is split: the head's size and a tail segment's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Split {
    head: u64,
    segment: u64,
}

/// How many locks the logs are spread over.
pub const LOCK_STRIPES: usize = 64;

/// What is stored of one task's log.
#[derive(Debug, Default)]
struct Layout {
    head: u64,
    /// (first offset, length), in order, contiguous.
    segments: Vec<(u64, u64)>,
}

impl Layout {
    fn end(&self) -> u64 {
        self.segments
            .last()
            .map_or(self.head, |&(start, len)| start + len)
    }

    fn tail_start(&self) -> u64 {
        self.segments.first().map_or(self.head, |&(start, _)| start)
    }
}

/// The smallest limit accepted: the marker and a few lines either side.
pub const MIN_LOG_BYTES: u64 = 4096;

impl LogStore {
    /// Logs under `dir`, each job's kept to at most `limit` bytes.
    pub fn new(dir: PathBuf, limit: u64) -> LogStore {
        LogStore {
            dir,
            limit,
            locks: (0..LOCK_STRIPES).map(|_| Mutex::new(())).collect(),
        }
    }

    /// The split of the log of one of a job's `tasks` tasks.
    fn split(&self, tasks: u32) -> Split {
        let limit = (self.limit / u64::from(tasks.max(1))).max(MIN_LOG_BYTES);
        let head = limit / 2;
        Split {
            head,
            segment: (limit - head) / 2,
        }
    }

    fn head_path(&self, allocation: u64) -> PathBuf {
        self.dir.join(format!("{allocation}.log"))
    }

    fn tail_dir(&self, allocation: u64) -> PathBuf {
        self.dir.join(format!("{allocation}.tail"))
    }

    fn eof_path(&self, allocation: u64) -> PathBuf {
        self.dir.join(format!("{allocation}.eof"))
    }

    fn guard(&self, allocation: u64) -> std::sync::MutexGuard<'_, ()> {
        let stripe = (allocation % LOCK_STRIPES as u64) as usize;
        self.locks[stripe]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn layout(&self, allocation: u64) -> Result<Layout, AppendError> {
        let head_path = self.head_path(allocation);
        let head = match std::fs::metadata(&head_path) {
            Ok(meta) => meta.len(),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => 0,
            Err(source) => return Err(io("read", &head_path, source)),
        };
        let tail_dir = self.tail_dir(allocation);
        let mut segments = Vec::new();
        match std::fs::read_dir(&tail_dir) {
            Ok(entries) => {
                for entry in entries {
                    let entry = entry.map_err(|source| io("list", &tail_dir, source))?;
                    let Some(start) = entry
                        .file_name()
                        .to_str()
                        .and_then(|name| name.parse::<u64>().ok())
                    else {
                        continue;
                    };
                    let len = entry
                        .metadata()
                        .map_err(|source| io("read", &entry.path(), source))?
                        .len();
                    segments.push((start, len));
                }
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(io("list", &tail_dir, source)),
        }
        segments.sort_unstable();
        Ok(Layout { head, segments })
    }

    /// Stores `data`, which starts at byte `offset` of the output of a task
    /// of a job with `tasks` tasks: bytes already stored are skipped (a
    /// retried chunk changes nothing); a chunk past the end is refused
    /// unless `omit_gap` is set and the head is full. `eof` records that
    /// the output is whole.
    pub fn append(
        &self,
        allocation: u64,
        tasks: u32,
        offset: u64,
        data: &[u8],
        omit_gap: bool,
        eof: bool,
    ) -> Result<Appended, AppendError> {
        let _guard = self.guard(allocation);
        let split = self.split(tasks);
        let mut layout = self.layout(allocation)?;
        let end = layout.end();
        let mut position = end;
        if offset > end {
            if !omit_gap {
                return Err(AppendError::Gap {
                    allocation,
                    offset,
                    end,
                });
            }
            if layout.head < split.head {
                return Err(AppendError::EarlySkip {
                    allocation,
                    offset,
                    end,
                    head: split.head,
                });
            }
            // Everything in the tail is older than `offset`, which is at
            // least the tail's length behind the sender's end: none of it
            // can be among the latest bytes any more.
            for &(start, _) in &layout.segments {
                let path = self.tail_dir(allocation).join(start.to_string());
                std::fs::remove_file(&path).map_err(|source| io("remove", &path, source))?;
            }
            layout.segments.clear();
            position = offset;
        }
        let skip = usize::try_from(position - offset).unwrap_or(usize::MAX);
        let mut rest = data.get(skip..).unwrap_or_default();
        while !rest.is_empty() {
            let written = self.write_some(allocation, split, &mut layout, position, rest)?;
            position += written as u64;
            rest = &rest[written..];
        }
        if eof {
            let path = self.eof_path(allocation);
            std::fs::write(&path, layout.end().to_string())
                .map_err(|source| io("write", &path, source))?;
        }
        Ok(Appended {
            end: layout.end(),
            head_bytes: split.head,
            tail_bytes: split.segment * 2,
        })
    }

    /// Writes a prefix of `data` at `position` (the log's end) into the
    /// head or the newest segment; returns how many bytes it took.
    fn write_some(
        &self,
        allocation: u64,
        split: Split,
        layout: &mut Layout,
        position: u64,
        data: &[u8],
    ) -> Result<usize, AppendError> {
        debug_assert_eq!(position.max(layout.end()), position);
        if layout.segments.is_empty() && position == layout.head && layout.head < split.head {
            let room = usize::try_from(split.head - layout.head).unwrap_or(usize::MAX);
            let take = room.min(data.len());
            let path = self.head_path(allocation);
            append_to(&path, &data[..take])?;
            layout.head += take as u64;
            return Ok(take);
        }
        let tail_dir = self.tail_dir(allocation);
        let newest = match layout.segments.last() {
            Some(&(start, len)) if start + len == position && len < split.segment => (start, len),
            _ => {
                std::fs::create_dir_all(&tail_dir)
                    .map_err(|source| io("create", &tail_dir, source))?;
                layout.segments.push((position, 0));
                while layout.segments.len() > 2 {
                    let (start, _) = layout.segments.remove(0);
                    let path = tail_dir.join(start.to_string());
                    std::fs::remove_file(&path).map_err(|source| io("remove", &path, source))?;
                }
                (position, 0)
            }
        };
        let room = usize::try_from(split.segment - newest.1).unwrap_or(usize::MAX);
        let take = room.min(data.len());
        append_to(&tail_dir.join(newest.0.to_string()), &data[..take])?;
        if let Some(last) = layout.segments.last_mut() {
            last.1 += take as u64;
        }
        Ok(take)
    }

    /// Up to `limit` bytes from byte `offset` of the task's output (or the
    /// marker standing for bytes left out).
    pub fn read(&self, allocation: u64, offset: u64, limit: usize) -> Result<LogRead, AppendError> {
        let _guard = self.guard(allocation);
        let layout = self.layout(allocation)?;
        let end = layout.end();
        let eof = self.eof_path(allocation).exists();
        let newest = match layout.segments.last() {
            Some(&(start, _)) => self.tail_dir(allocation).join(start.to_string()),
            None => self.head_path(allocation),
        };
        let modified = std::fs::metadata(&newest)
            .and_then(|meta| meta.modified())
            .ok();
        let tail_start = layout.tail_start();
        let (data, next_offset) = if offset < layout.head {
            let want = (layout.head - offset).min(limit as u64);
            let path = self.head_path(allocation);
            (read_at(&path, offset, want)?, offset + want)
        } else if offset < tail_start {
            let marker = format!("\n[muster: {} bytes omitted]\n", tail_start - offset);
            (marker.into_bytes(), tail_start)
        } else if let Some(&(start, len)) = layout
            .segments
            .iter()
            .find(|&&(start, len)| start <= offset && offset < start + len)
        {
            let want = (start + len - offset).min(limit as u64);
            let path = self.tail_dir(allocation).join(start.to_string());
            (read_at(&path, offset - start, want)?, offset + want)
        } else {
            (Vec::new(), offset)
        };
        Ok(LogRead {
            data,
            next_offset,
            end,
            eof,
            modified,
        })
    }
}

fn io(what: &'static str, path: &Path, source: std::io::Error) -> AppendError {
    AppendError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn append_to(path: &Path, data: &[u8]) -> Result<(), AppendError> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.create(true).append(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .map_err(|source| io("open", path, source))?;
    file.write_all(data)
        .map_err(|source| io("write", path, source))
}

fn read_at(path: &Path, offset: u64, want: u64) -> Result<Vec<u8>, AppendError> {
    use std::io::{Read, Seek};
    let mut file = std::fs::File::open(path).map_err(|source| io("open", path, source))?;
    file.seek(std::io::SeekFrom::Start(offset))
        .map_err(|source| io("read", path, source))?;
    let mut data = Vec::with_capacity(usize::try_from(want).unwrap_or(0));
    file.take(want)
        .read_to_end(&mut data)
        .map_err(|source| io("read", path, source))?;
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(limit: u64) -> (tempfile::TempDir, LogStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::new(dir.path().to_path_buf(), limit);
        (dir, store)
    }

    /// Everything a reader gets from offset 0, paging with `limit`.
    fn read_all(store: &LogStore, allocation: u64, limit: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut offset = 0;
        loop {
            let read = store.read(allocation, offset, limit).unwrap();
            if read.data.is_empty() {
                return out;
            }
            out.extend_from_slice(&read.data);
            offset = read.next_offset;
        }
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn stores_exact_bytes_and_ignores_retries() {
        let (_dir, store) = store(1 << 20);
        let data = bytes(10_000, 7);
        assert_eq!(
            store
                .append(1, 1, 0, &data[..6000], false, false)
                .unwrap()
                .end,
            6000
        );
        // A retry, and an overlap: only the new part is written.
        assert_eq!(
            store
                .append(1, 1, 0, &data[..6000], false, false)
                .unwrap()
                .end,
            6000
        );
        let appended = store
            .append(1, 1, 4000, &data[4000..], false, true)
            .unwrap();
        assert_eq!(appended.end, 10_000);
        assert_eq!(
            (appended.head_bytes, appended.tail_bytes),
            (524_288, 524_288)
        );
        assert_eq!(read_all(&store, 1, 777), data);
        let read = store.read(1, 10_000, 10).unwrap();
        assert!(read.eof && read.data.is_empty());
        assert_eq!(read.next_offset, 10_000);
        // An empty chunk at 0 asks where the log ends.
        assert_eq!(
            store.append(1, 1, 0, &[], false, false).unwrap().end,
            10_000
        );
    }

    #[test]
    fn a_gap_is_refused_with_where_to_resume() {
        let (_dir, store) = store(1 << 20);
        store.append(2, 1, 0, b"hello", false, false).unwrap();
        let error = store.append(2, 1, 9, b"x", false, false).unwrap_err();
        assert!(error.to_string().contains("send from byte 5"), "{error}");
        // Skipping is only for a log whose head is full.
        let error = store.append(2, 1, 9, b"x", true, false).unwrap_err();
        assert!(error.to_string().contains("send from byte 5"), "{error}");
    }

    #[test]
    fn a_log_past_its_limit_keeps_head_and_tail_with_a_marker() {
        let limit = 8192u64;
        let (dir, store) = store(limit);
        let data = bytes(100_000, 3);
        for (i, piece) in data.chunks(1500).enumerate() {
            store
                .append(3, 1, i as u64 * 1500, piece, false, false)
                .unwrap();
        }
        let got = read_all(&store, 3, 1000);
        let head = &data[..4096];
        assert_eq!(&got[..4096], head);
        let marker_end = got[4096..]
            .iter()
            .skip(1)
            .position(|&b| b == b'\n')
            .unwrap()
            + 4098;
        let marker = std::str::from_utf8(&got[4096..marker_end]).unwrap();
        let tail = &got[marker_end..];
        assert!(tail.len() >= 2048 && tail.len() <= 4096, "{}", tail.len());
        assert_eq!(tail, &data[data.len() - tail.len()..]);
        let omitted = data.len() - 4096 - tail.len();
        assert_eq!(marker, format!("\n[muster: {omitted} bytes omitted]\n"));
        // Bounded on disk.
        let stored: u64 = walk(dir.path());
        assert!(stored <= limit + 64, "{stored}");
    }

    #[test]
    fn a_sender_far_behind_may_skip_once_the_head_is_full() {
        let (_dir, store) = store(8192);
        let data = bytes(50_000, 9);
        let appended = store.append(4, 1, 0, &data[..5000], false, false).unwrap();
        assert_eq!((appended.head_bytes, appended.tail_bytes), (4096, 4096));
        let appended = store
            .append(4, 1, 40_000, &data[40_000..], true, true)
            .unwrap();
        assert_eq!(appended.end, 50_000);
        let got = read_all(&store, 4, 100_000);
        assert_eq!(&got[..4096], &data[..4096]);
        assert!(got.ends_with(&data[data.len() - 2048..]));
        // A follower that was in the dropped part resumes at the tail.
        let read = store.read(4, 4500, 100).unwrap();
        assert!(String::from_utf8_lossy(&read.data).contains("bytes omitted"));
        assert!(read.next_offset > 40_000);
    }

    #[test]
    fn the_limit_is_shared_by_a_jobs_tasks() {
        let (_dir, store) = store(1 << 20);
        let one = store.append(5, 1, 0, b"x", false, false).unwrap();
        assert_eq!((one.head_bytes, one.tail_bytes), (1 << 19, 1 << 19));
        let of_four = store.append(6, 4, 0, b"x", false, false).unwrap();
        assert_eq!((of_four.head_bytes, of_four.tail_bytes), (1 << 17, 1 << 17));
        // Never below the smallest limit.
        let of_many = store.append(7, 10_000, 0, b"x", false, false).unwrap();
        assert_eq!(
            (of_many.head_bytes, of_many.tail_bytes),
            (MIN_LOG_BYTES / 2, MIN_LOG_BYTES / 2)
        );
    }

    fn walk(path: &Path) -> u64 {
        std::fs::read_dir(path)
            .unwrap()
            .flatten()
            .map(|entry| {
                let meta = entry.metadata().unwrap();
                if meta.is_dir() {
                    walk(&entry.path())
                } else {
                    meta.len()
                }
            })
            .sum()
    }
}
