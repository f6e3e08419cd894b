//! `muster top`: a live terminal view of the cluster: nodes with a bar per
//! GPU, and the jobs not ended with their utilisation (ratatui). `--once`
//! prints one frame as text, for scripts and terminals without a screen.

use super::{Connection, Failure, runtime};
use anyhow::Context;
use clap::Args;
use muster_api::protocol::{JobView, NodeView};
use ratatui::Terminal;
use ratatui::backend::{Backend, TestBackend};
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct TopArgs {
    /// How often to refresh.
    #[arg(long, default_value = "2s", value_parser = parse_interval)]
    pub interval: Duration,
    /// Print one frame as text and exit.
    #[arg(long)]
    pub once: bool,
    /// The frame's width and height with --once.
    #[arg(long, default_value = "120x40", value_parser = parse_size)]
    pub size: (u16, u16),
    #[command(flatten)]
    pub connection: Connection,
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = muster_api::parse_duration_text(text)?;
    if interval < Duration::from_millis(200) {
        return Err("the interval is at least 200ms".to_string());
    }
    Ok(interval)
}

fn parse_size(text: &str) -> Result<(u16, u16), String> {
    let (w, h) = text
        .split_once('x')
        .ok_or_else(|| format!("expected WIDTHxHEIGHT like 120x40, got {text:?}"))?;
    let parse = |v: &str| {
        v.trim()
            .parse::<u16>()
            .ok()
            .filter(|n| (20..=1000).contains(n))
    };
    match (parse(w), parse(h)) {
        (Some(w), Some(h)) => Ok((w, h)),
        _ => Err(format!(
            "width and height are from 20 to 1000, got {text:?}"
        )),
    }
}

/// What one frame shows.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub nodes: Vec<NodeView>,
    pub jobs: Vec<JobView>,
    pub server: String,
}

async fn fetch(client: &muster_api::client::Client, server: &str) -> anyhow::Result<Snapshot> {
    let nodes = client.nodes().await?.nodes;
    let filter = muster_api::client::JobFilter {
        active: true,
        limit: Some(1000),
        ..Default::default()
    };
    let jobs = client.jobs(&filter).await?.jobs;
    Ok(Snapshot {
        nodes,
        jobs,
        server: server.to_string(),
    })
}

pub fn top(args: TopArgs) -> Result<u8, Failure> {
    let client = args.connection.client()?;
    let server = client.base().to_string();
    let rt = runtime()?;
    if args.once {
        let snapshot = rt.block_on(fetch(&client, &server))?;
        let (width, height) = args.size;
        let mut terminal = Terminal::new(TestBackend::new(width, height)).context("a frame")?;
        terminal
            .draw(|frame| draw(frame, &snapshot, 0))
            .context("cannot draw")?;
        super::write_bytes(buffer_text(terminal.backend().buffer()).as_bytes());
        return Ok(0);
    }
    let mut terminal = ratatui::try_init()
        .context("cannot take over the terminal (is this an interactive terminal? try --once)")?;
    let result = live(&rt, &client, &server, args.interval, &mut terminal);
    ratatui::restore();
    result?;
    Ok(0)
}

fn live<B: Backend>(
    rt: &tokio::runtime::Runtime,
    client: &muster_api::client::Client,
    server: &str,
    interval: Duration,
    terminal: &mut Terminal<B>,
) -> anyhow::Result<()> {
    let mut snapshot = Snapshot {
        server: server.to_string(),
        ..Snapshot::default()
    };
    let mut problem: Option<String> = None;
    let mut scroll = 0usize;
    let mut next = Instant::now();
    loop {
        if Instant::now() >= next {
            match rt.block_on(fetch(client, server)) {
                Ok(fresh) => {
                    snapshot = fresh;
                    problem = None;
                }
                // Shown, and tried again: a server restart passes.
                Err(error) => problem = Some(format!("{error:#}")),
            }
            next = Instant::now() + interval;
        }
        terminal.draw(|frame| {
            draw(frame, &snapshot, scroll);
            if let Some(problem) = &problem {
                let area = Rect {
                    y: frame.area().height.saturating_sub(1),
                    height: 1,
                    ..frame.area()
                };
                frame.render_widget(
                    Paragraph::new(format!("cannot refresh: {problem}"))
                        .style(Style::default().fg(Color::Red)),
                    area,
                );
            }
        })?;
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait.min(Duration::from_millis(250)))?
            && let Event::Key(key) = event::read()?
            && key.kind == KeyEventKind::Press
        {
            match key.code {
                KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                    return Ok(());
                }
                KeyCode::Down | KeyCode::Char('j') => {
                    scroll = (scroll + 1).min(snapshot.jobs.len().saturating_sub(1));
                }
                KeyCode::Up | KeyCode::Char('k') => scroll = scroll.saturating_sub(1),
                KeyCode::Char('r') => next = Instant::now(),
                _ => {}
            }
        }
    }
}

/// A bar of `width` cells, `pct` full.
fn bar(pct: u32, width: usize) -> String {
    let filled = (pct.min(100) as usize * width).div_ceil(100);
    format!("{}{}", "█".repeat(filled), "·".repeat(width - filled))
}

fn utilization_colour(pct: u32) -> Color {
    match pct {
        0..5 => Color::Yellow,
        5..60 => Color::Cyan,
        _ => Color::Green,
    }
}

/// One frame: the summary, the nodes, the jobs (from row `scroll`).
pub fn draw(frame: &mut ratatui::Frame<'_>, snapshot: &Snapshot, scroll: usize) {
    let gpus: usize = snapshot.nodes.iter().map(|n| n.gpus.len()).sum();
    let allocated: usize = snapshot
        .nodes
        .iter()
        .map(|n| n.gpu_free.iter().filter(|free| **free < 1000).count())
        .sum();
    let unhealthy: usize = snapshot.nodes.iter().map(|n| n.unhealthy_gpus.len()).sum();
    let running = snapshot
        .jobs
        .iter()
        .filter(|j| j.state == "running")
        .count();
    let pending = snapshot
        .jobs
        .iter()
        .filter(|j| j.state == "pending")
        .count();
    let idle = snapshot
        .jobs
        .iter()
        .filter(|j| j.idle_for_s.is_some())
        .count();
    let node_rows = snapshot.nodes.len().min(16) as u16;
    let [summary, nodes_area, jobs_area] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(node_rows + 3),
        Constraint::Min(4),
    ])
    .areas(frame.area());
    frame.render_widget(
        Paragraph::new(vec![
            Line::from(vec![
                Span::styled("muster top", Style::default().add_modifier(Modifier::BOLD)),
                Span::raw(format!("  {}  (q quits, ↑↓ scroll)", snapshot.server)),
            ]),
            Line::from(format!(
                "nodes {}  GPUs {gpus}: {allocated} allocated, {} free, {unhealthy} out of \
                 service   jobs: {running} running ({idle} idle), {pending} pending",
                snapshot.nodes.len(),
                gpus.saturating_sub(allocated + unhealthy)
            )),
        ]),
        summary,
    );
    let node_table = Table::new(
        snapshot.nodes.iter().take(16).map(|node| {
            let mut spans = Vec::new();
            for gpu in &node.gpus {
                let util = node
                    .gpu_utilization_pct
                    .get(gpu.index as usize)
                    .copied()
                    .unwrap_or(0);
                let (text, colour) = if node.unhealthy_gpus.contains(&gpu.index) {
                    ("XXXX".to_string(), Color::Red)
                } else if node.gpu_free.get(gpu.index as usize) == Some(&1000) {
                    (bar(util, 4), Color::DarkGray)
                } else {
                    (bar(util, 4), utilization_colour(util))
                };
                spans.push(Span::styled(text, Style::default().fg(colour)));
                spans.push(Span::raw(" "));
            }
            Row::new(vec![
                Line::from(node.name.clone()),
                Line::from(node.state.clone()),
                Line::from(node.pool.clone()),
                Line::from(spans),
            ])
        }),
        [
            Constraint::Length(20),
            Constraint::Length(8),
            Constraint::Length(12),
            Constraint::Min(20),
        ],
    )
    .header(Row::new([
        "NODE",
        "STATE",
        "POOL",
        "GPUS (utilisation; dim: free)",
    ]))
    .block(Block::default().borders(Borders::TOP).title(format!(
        " nodes{} ",
        if snapshot.nodes.len() > 16 {
            format!(" (16 of {})", snapshot.nodes.len())
        } else {
            String::new()
        }
    )));
    frame.render_widget(node_table, nodes_area);
    let job_table = Table::new(
        snapshot.jobs.iter().skip(scroll).map(|job| {
            let mean = job
                .tasks
                .iter()
                .filter_map(|t| t.usage.as_ref().map(|u| u.mean_utilization_pct))
                .fold((0.0, 0u32), |(sum, n), mean| (sum + mean, n + 1));
            let util = (mean.1 > 0).then(|| (mean.0 / f64::from(mean.1)).round() as u32);
            let usage = match util {
                Some(util) => Span::styled(
                    format!("{} {util:>3}%", bar(util, 10)),
                    Style::default().fg(utilization_colour(util)),
                ),
                None => Span::raw(""),
            };
            let state = match job.idle_for_s {
                Some(_) => format!("{} (idle)", job.state),
                None => job.state.clone(),
            };
            let place = if job.state == "pending" {
                job.pending_code.clone().unwrap_or_default()
            } else {
                job.tasks
                    .iter()
                    .map(|t| t.node.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            Row::new(vec![
                Line::from(job.id.to_string()),
                Line::from(job.name.clone()),
                Line::from(job.user.clone()),
                Line::from(job.queue.clone()),
                Line::from(state),
                Line::from(format!("{}x{}", job.nodes, job.gpus_per_node)),
                Line::from(usage),
                Line::from(place),
            ])
        }),
        [
            Constraint::Length(7),
            Constraint::Length(16),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(15),
            Constraint::Length(6),
            Constraint::Length(16),
            Constraint::Min(10),
        ],
    )
    .header(Row::new([
        "ID",
        "NAME",
        "USER",
        "QUEUE",
        "STATE",
        "GPUS",
        "UTILISATION",
        "WHERE / WHY",
    ]))
    .block(Block::default().borders(Borders::TOP).title(" jobs "));
    frame.render_widget(job_table, jobs_area);
}

/// A buffer's text, a line per row, trailing spaces trimmed.
fn buffer_text(buffer: &Buffer) -> String {
    let area = buffer.area;
    let mut text = String::new();
    for y in 0..area.height {
        let mut line = String::new();
        for x in 0..area.width {
            line.push_str(buffer[(x, y)].symbol());
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_api::protocol::{GpuView, TaskUsage, TaskView};

    fn node(name: &str, utilization: Vec<u32>, free: Vec<u32>, unhealthy: Vec<u32>) -> NodeView {
        NodeView {
            name: name.to_string(),
            state: "ready".to_string(),
            cordoned: false,
            draining: false,
            pool: "default".to_string(),
            rack: "default".to_string(),
            address: "127.0.0.1".to_string(),
            gpus: (0..free.len() as u32)
                .map(|index| GpuView {
                    index,
                    uuid: format!("GPU-{index}"),
                    model: "H100-80GB".to_string(),
                    memory_mib: 81_920,
                    nvlink_domain: 0,
                })
                .collect(),
            gpu_free: free,
            cpu_milli: 8_000,
            memory_mib: 65_536,
            backend: "simulated".to_string(),
            driver_version: None,
            cuda_version: None,
            stack: Default::default(),
            drift: None,
            last_heartbeat_ms: 0,
            recent_heartbeat_gaps_ms: Vec::new(),
            allocations: Vec::new(),
            unhealthy_gpus: unhealthy,
            gpu_events: Vec::new(),
            gpu_utilization_pct: utilization,
            excluded: None,
        }
    }

    #[test]
    fn a_frame_shows_the_nodes_gpus_and_the_jobs_utilisation() {
        let job: JobView = serde_json::from_value(serde_json::json!({
            "id": 7, "name": "train", "user": "alice", "queue": "team-a",
            "priority_class": "normal", "state": "running", "nodes": 1, "gpus_per_node": 2.0,
            "submitted_ms": 0, "started_ms": 0, "finished_ms": null, "exit_code": null,
            "attempts": 1, "command": ["python"], "tasks": [], "pending_reason": null,
            "queue_position": null, "history": []
        }))
        .expect("a job");
        let mut job = job;
        job.tasks.push(TaskView {
            pulling: None,
            rank: 0,
            node: "gpu-1".to_string(),
            gpus: vec![(0, 1000), (1, 1000)],
            allocation: 1,
            generation: 1,
            state: "running".to_string(),
            exit_code: None,
            usage: Some(TaskUsage {
                samples: 3,
                mean_utilization_pct: 90.0,
                peak_utilization_pct: 95,
                peak_memory_mib: 1_000,
                idle_since_ms: None,
            }),
        });
        let snapshot = Snapshot {
            nodes: vec![node(
                "gpu-1",
                vec![90, 90, 0, 0],
                vec![0, 0, 1000, 1000],
                vec![3],
            )],
            jobs: vec![job],
            server: "http://127.0.0.1:7070".to_string(),
        };
        let mut terminal = Terminal::new(TestBackend::new(120, 30)).expect("a terminal");
        terminal
            .draw(|frame| draw(frame, &snapshot, 0))
            .expect("drawn");
        let text = buffer_text(terminal.backend().buffer());
        assert!(
            text.contains("GPUs 4: 2 allocated, 1 free, 1 out of service"),
            "{text}"
        );
        assert!(
            text.contains("jobs: 1 running (0 idle), 0 pending"),
            "{text}"
        );
        let node_line = text
            .lines()
            .find(|l| l.starts_with("gpu-1"))
            .expect("the node");
        assert!(node_line.contains("████ ████ ···· XXXX"), "{node_line}");
        let job_line = text.lines().find(|l| l.starts_with("7 ")).expect("the job");
        assert!(job_line.contains("█████████·  90%"), "{job_line}");
        assert!(
            job_line.contains("alice") && job_line.contains("gpu-1"),
            "{job_line}"
        );
    }

    #[test]
    fn sizes_and_intervals_are_checked() {
        assert_eq!(parse_size("100x30"), Ok((100, 30)));
        assert!(parse_size("10x5").is_err());
        assert!(parse_size("wide").is_err());
        assert!(parse_interval("50ms").is_err());
        assert_eq!(parse_interval("1s"), Ok(Duration::from_secs(1)));
    }
}
