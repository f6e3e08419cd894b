//! Job lists for time replay: the Microsoft Philly derived job list
//! (`timestamp,duration,num_gpus,gpu_time,cluster`), the openb pod lists
//! with their `creation_time` and `deletion_time` columns, and a muster
//! cluster's own history (`muster history export`).

use crate::replay::ReplayJob;
use crate::trace::{Row, Table, TraceError, parse_openb_tasks};
use muster_model::{CpuMilli, GpuRequest, MemoryMib};

/// Days from 1970-01-01 to a proleptic Gregorian date.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// Seconds since the Unix epoch of `YYYY-MM-DD HH:MM:SS` (UTC).
fn parse_timestamp(text: &str) -> Option<i64> {
    let (date, time) = text.trim().split_once(' ')?;
    let mut date = date.split('-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (date.next()??, date.next()??, date.next()??);
    let mut time = time.split(':').map(|p| p.parse::<i64>().ok());
    let (hour, minute, second) = (time.next()??, time.next()??, time.next()??);
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || !(0..24).contains(&hour)
        || !(0..60).contains(&minute)
        || !(0..=60).contains(&second)
    {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second)
}

/// Parses the Philly job list. A job asking for more GPUs than
/// `gpus_per_node` becomes a gang of `ceil(gpus / gpus_per_node)` tasks with
/// `ceil(gpus / tasks)` GPUs each. Submit times are counted from the first
/// job's. Jobs take no CPU or memory (the trace has none).
pub fn parse_philly(
    text: &str,
    file_name: &str,
    gpus_per_node: u32,
) -> Result<Vec<ReplayJob>, TraceError> {
    let table = Table::parse(
        text,
        file_name,
        "timestamp,duration,num_gpus,gpu_time,cluster",
    )?;
    let timestamp = table.column("timestamp")?;
    let duration = table.column("duration")?;
    let num_gpus = table.column("num_gpus")?;
    let cluster = table.column("cluster")?;
    let per_node = gpus_per_node.max(1);
    let mut jobs = Vec::with_capacity(table.rows.len());
    let mut first: Option<i64> = None;
    for (line, fields) in &table.rows {
        let row = Row {
            file: file_name,
            line: *line,
            fields,
        };
        let submitted = parse_timestamp(row.text(timestamp))
            .ok_or_else(|| row.error(timestamp, "a UTC time as YYYY-MM-DD HH:MM:SS"))?;
        let seconds = row
            .text(duration)
            .parse::<f64>()
            .ok()
            .filter(|d| d.is_finite() && *d >= 0.0)
            .ok_or_else(|| row.error(duration, "a non-negative number of seconds"))?;
        let gpus = row.integer(num_gpus, 1..=4096)? as u32;
        let queue = row.text(cluster);
        if queue.is_empty() {
            return Err(row.error(cluster, "a virtual cluster name"));
        }
        let tasks = gpus.div_ceil(per_node);
        let first = *first.get_or_insert(submitted);
        jobs.push(ReplayJob {
            id: jobs.len() as u64,
            submit_s: submitted.saturating_sub(first).max(0) as u64,
            duration_s: seconds.ceil() as u64,
            queue: queue.to_string(),
            tasks,
            gpus_per_task: GpuRequest::Whole(gpus.div_ceil(tasks)),
            cpu: CpuMilli(0),
            memory: MemoryMib(0),
            gpu_models: Vec::new(),
        });
    }
    Ok(jobs)
}

/// The header `muster history export` writes and [`parse_muster_history`]
/// reads.
pub const MUSTER_HISTORY_HEADER: &str =
    "id,submitted_ms,started_ms,finished_ms,nodes,gpus_per_node,queue,user,state";

/// Parses a muster cluster's history (`muster history export`): each job
/// that ran is a job of `nodes` tasks of `gpus_per_node` GPUs (a share of
/// one below 1) in its queue, submitted at `submitted_ms` (counted from the
/// first job's) and running for `finished_ms - started_ms`. Jobs take no CPU
/// or memory in the replay.
pub fn parse_muster_history(text: &str, file_name: &str) -> Result<Vec<ReplayJob>, TraceError> {
    let table = Table::parse(text, file_name, MUSTER_HISTORY_HEADER)?;
    let submitted = table.column("submitted_ms")?;
    let started = table.column("started_ms")?;
    let finished = table.column("finished_ms")?;
    let nodes = table.column("nodes")?;
    let gpus_per_node = table.column("gpus_per_node")?;
    let queue = table.column("queue")?;
    let mut rows = Vec::with_capacity(table.rows.len());
    for (line, fields) in &table.rows {
        let row = Row {
            file: file_name,
            line: *line,
            fields,
        };
        let submit = row.integer(submitted, 0..=u64::MAX)?;
        let start = row.integer(started, submit..=u64::MAX)?;
        let end = row.integer(finished, start..=u64::MAX)?;
        let tasks = row.integer(nodes, 1..=4096)? as u32;
        let gpus = row
            .text(gpus_per_node)
            .parse::<f64>()
            .ok()
            .filter(|g| g.is_finite() && *g >= 0.0 && *g <= 64.0)
            .and_then(|g| {
                if g >= 1.0 || g == 0.0 {
                    (g.fract() == 0.0).then_some(GpuRequest::Whole(g as u32))
                } else {
                    let milli = (g * 1000.0).round() as u32;
                    (1..1000)
                        .contains(&milli)
                        .then_some(GpuRequest::Shared(muster_model::GpuMilli(milli)))
                }
            })
            .ok_or_else(|| {
                row.error(
                    gpus_per_node,
                    "GPUs per node: a whole number up to 64, or a share of one GPU below 1",
                )
            })?;
        let queue_name = row.text(queue);
        if queue_name.is_empty() {
            return Err(row.error(queue, "a queue name"));
        }
        rows.push((submit, end - start, queue_name.to_string(), tasks, gpus));
    }
    // Replays go in submission order; times count from the first.
    rows.sort_by_key(|row| row.0);
    let first = rows.first().map_or(0, |row| row.0);
    Ok(rows
        .into_iter()
        .enumerate()
        .map(|(id, (submit, run_ms, queue, tasks, gpus))| ReplayJob {
            id: id as u64,
            submit_s: (submit - first) / 1000,
            duration_s: run_ms.div_ceil(1000),
            queue,
            tasks,
            gpus_per_task: gpus,
            cpu: CpuMilli(0),
            memory: MemoryMib(0),
            gpu_models: Vec::new(),
        })
        .collect())
}

/// Parses an openb pod list with `creation_time` and `deletion_time`
/// (seconds): each pod is a one-task job held for the difference, in the
/// queue named by its `qos` column when present (else `default`).
pub fn parse_openb_timed(text: &str, file_name: &str) -> Result<Vec<ReplayJob>, TraceError> {
    let tasks = parse_openb_tasks(text, file_name)?;
    let table = Table::parse(text, file_name, "name,...,creation_time,deletion_time")?;
    let created = table.column("creation_time")?;
    let deleted = table.column("deletion_time")?;
    let qos = table.optional_column("qos");
    let mut jobs = Vec::with_capacity(tasks.len());
    for ((line, fields), task) in table.rows.iter().zip(tasks) {
        let row = Row {
            file: file_name,
            line: *line,
            fields,
        };
        let start = row.integer(created, 0..=u64::MAX)?;
        let end = row.integer(deleted, 0..=u64::MAX)?;
        if end < start {
            return Err(row.error(deleted, format!("a time at or after creation_time {start}")));
        }
        let queue = qos
            .map(|column| row.text(column))
            .filter(|q| !q.is_empty())
            .unwrap_or("default");
        jobs.push(ReplayJob {
            id: jobs.len() as u64,
            submit_s: start,
            duration_s: end - start,
            queue: queue.to_string(),
            tasks: 1,
            gpus_per_task: task.gpus,
            cpu: task.cpu,
            memory: task.memory,
            gpu_models: task.gpu_models,
        });
    }
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_muster_history_replays_in_submission_order() {
        let text = format!(
            "{MUSTER_HISTORY_HEADER}\n\
             7,5000,9000,69000,2,8,team-a,alice,succeeded\n\
             3,1000,1500,3100,1,0.25,team-b,bob,failed\n"
        );
        let jobs = parse_muster_history(&text, "jobs.csv").unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].queue, "team-b");
        assert_eq!((jobs[0].submit_s, jobs[0].duration_s), (0, 2));
        assert_eq!(
            jobs[0].gpus_per_task,
            GpuRequest::Shared(muster_model::GpuMilli(250))
        );
        assert_eq!(
            (jobs[1].submit_s, jobs[1].duration_s, jobs[1].tasks),
            (4, 60, 2)
        );
        assert_eq!(jobs[1].gpus_per_task, GpuRequest::Whole(8));
        let bad = format!("{MUSTER_HISTORY_HEADER}\n1,5,4,9,1,1.5,q,u,succeeded\n");
        let error = parse_muster_history(&bad, "jobs.csv")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("jobs.csv") && error.contains("started_ms"),
            "{error}"
        );
    }

    #[test]
    fn timestamps_are_utc_seconds() {
        assert_eq!(parse_timestamp("1970-01-01 00:00:00"), Some(0));
        assert_eq!(parse_timestamp("2017-09-04 10:30:41"), Some(1_504_521_041));
        assert_eq!(parse_timestamp("2017-13-04 10:30:41"), None);
        assert_eq!(parse_timestamp("yesterday"), None);
    }

    #[test]
    fn philly_jobs_above_a_node_become_gangs() {
        let text = "timestamp,duration,num_gpus,gpu_time,cluster\n\
                    2017-09-04 10:30:41,100.0,8,800.0,a\n\
                    2017-09-04 10:31:41,50.5,16,808.0,b\n\
                    2017-09-04 10:32:41,10.0,12,120.0,b\n";
        let jobs = parse_philly(text, "p.csv", 8).unwrap();
        assert_eq!(jobs.len(), 3);
        assert_eq!((jobs[0].submit_s, jobs[0].tasks), (0, 1));
        assert_eq!(jobs[1].submit_s, 60);
        assert_eq!(jobs[1].duration_s, 51);
        assert_eq!(
            (jobs[1].tasks, jobs[1].gpus_per_task),
            (2, GpuRequest::Whole(8))
        );
        assert_eq!(
            (jobs[2].tasks, jobs[2].gpus_per_task),
            (2, GpuRequest::Whole(6))
        );
    }

    #[test]
    fn malformed_philly_rows_name_line_and_column() {
        let text = "timestamp,duration,num_gpus,gpu_time,cluster\n\
                    2017-09-04 10:30:41,100.0,eight,800.0,a\n";
        let error = parse_philly(text, "p.csv", 8).unwrap_err().to_string();
        assert!(error.starts_with("p.csv:2: column num_gpus"), "{error}");
        let text = "timestamp,duration,num_gpus,gpu_time,cluster\n\
                    2017-09-04,100.0,8,800.0,a\n";
        let error = parse_philly(text, "p.csv", 8).unwrap_err().to_string();
        assert!(error.contains("column timestamp"), "{error}");
    }

    #[test]
    fn openb_pods_become_timed_jobs() {
        let text = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
                    p0,1000,1024,1,500,,LS,Running,10,110,10\n\
                    p1,1000,1024,2,1000,,BE,Running,20,15,20\n";
        let error = parse_openb_timed(text, "o.csv").unwrap_err().to_string();
        assert!(error.contains("o.csv:3: column deletion_time"), "{error}");
        let text = text.replace(",20,15,20", ",20,25,20");
        let jobs = parse_openb_timed(&text, "o.csv").unwrap();
        assert_eq!(jobs[0].duration_s, 100);
        assert_eq!(jobs[0].queue, "LS");
        assert_eq!(jobs[1].gpus_per_task, GpuRequest::Whole(2));
    }
}
