//! Other task mixes from one pod list, to test that a placement policy holds
//! up beyond the traces it was measured on.
//!
//! The FGD authors publish variants of the openb pod list (more or fewer
//! GPU-sharing tasks, multi-GPU tasks, CPU-only tasks, GPU-model
//! constraints, CPU-heavy tasks); only three of them are in `../shared`.
//! [`resample`] builds such variants from any pod list by one stated rule per
//! kind of change (see [`MixChange`]), deterministically from a seed. They
//! are muster's own variants, not copies of the authors' files.

use crate::trace::TraceTask;
use muster_model::{CpuMilli, GpuModel, GpuRequest, NodeSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;

/// One change to a pod list's mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixChange {
    /// This percentage of the GPU tasks share one GPU: as many GPU tasks as
    /// before, each drawn (with replacement) from the sharing tasks with
    /// that probability, otherwise from the other GPU tasks. CPU-only tasks
    /// are kept as they are.
    Share(u8),
    /// This percentage of the GPU tasks ask for more than one GPU (drawn as
    /// for [`MixChange::Share`]).
    MultiGpu(u8),
    /// This percentage of all tasks are CPU-only: as many tasks as before,
    /// each drawn from the CPU-only tasks with that probability, otherwise
    /// from the GPU tasks.
    CpuOnly(u8),
    /// This percentage of the GPU tasks (each with that probability) may run
    /// on one GPU model only: the model of a GPU drawn uniformly from the
    /// GPUs of the nodes that have enough GPUs for the task. Other tasks keep
    /// their constraints.
    GpuSpec(u8),
    /// Every task's CPU request is scaled to this percentage (200: twice).
    CpuScale(u32),
}

impl fmt::Display for MixChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MixChange::Share(pct) => write!(f, "{pct}% of GPU tasks share a GPU"),
            MixChange::MultiGpu(pct) => write!(f, "{pct}% of GPU tasks ask for several GPUs"),
            MixChange::CpuOnly(pct) => write!(f, "{pct}% of tasks are CPU-only"),
            MixChange::GpuSpec(pct) => write!(f, "{pct}% of GPU tasks constrained to one model"),
            MixChange::CpuScale(pct) => write!(f, "CPU requests scaled to {pct}%"),
        }
    }
}

/// Why a mix cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MixError {
    #[error("{what} must be a percentage from 0 to 100, got {got}")]
    Percentage { what: &'static str, got: u32 },
    #[error("the CPU scale must be 1 to 10000 percent, got {0}")]
    Scale(u32),
    #[error(
        "the pod list has no {missing} to draw from, so {change} cannot be built; \
         use a pod list that has some, or 0/100 percent"
    )]
    NothingToDraw {
        missing: &'static str,
        change: String,
    },
    #[error(
        "no node has {gpus} GPUs for task {task}, so it cannot be given a GPU model; \
         pass the node list the pod list was made for"
    )]
    NoNodeFor { task: String, gpus: u32 },
}

fn is_gpu(task: &TraceTask) -> bool {
    task.gpus.total().0 > 0
}

fn is_share(task: &TraceTask) -> bool {
    matches!(task.gpus, GpuRequest::Shared(_))
}

fn is_multi(task: &TraceTask) -> bool {
    task.gpus.gpu_count() > 1
}

/// A variant of `tasks` with `change` applied; `nodes` are the cluster's
/// (used by [`MixChange::GpuSpec`] only). Tasks are renamed `mix-N` in the
/// order they are drawn; the same inputs and seed give the same list.
pub fn resample(
    tasks: &[TraceTask],
    nodes: &[NodeSpec],
    change: MixChange,
    seed: u64,
) -> Result<Vec<TraceTask>, MixError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out: Vec<TraceTask> = match change {
        MixChange::Share(pct) => redraw(tasks, pct, "share", is_gpu, is_share, change, &mut rng)?,
        MixChange::MultiGpu(pct) => {
            redraw(tasks, pct, "multi-GPU", is_gpu, is_multi, change, &mut rng)?
        }
        MixChange::CpuOnly(pct) => redraw(
            tasks,
            pct,
            "CPU-only",
            |_| true,
            |task| !is_gpu(task),
            change,
            &mut rng,
        )?,
        MixChange::GpuSpec(pct) => {
            check_percentage("the GPU-model percentage", pct)?;
            let mut out = Vec::with_capacity(tasks.len());
            for task in tasks {
                let mut task = task.clone();
                if is_gpu(&task) && rng.random_range(0..100u32) < u32::from(pct) {
                    task.gpu_models = vec![draw_model(nodes, &task, &mut rng)?];
                }
                out.push(task);
            }
            out
        }
        MixChange::CpuScale(pct) => {
            if !(1..=10_000).contains(&pct) {
                return Err(MixError::Scale(pct));
            }
            tasks
                .iter()
                .map(|task| TraceTask {
                    cpu: CpuMilli(task.cpu.0.saturating_mul(u64::from(pct)) / 100),
                    ..task.clone()
                })
                .collect()
        }
    };
    for (index, task) in out.iter_mut().enumerate() {
        task.name = format!("mix-{index}");
    }
    Ok(out)
}

fn check_percentage(what: &'static str, pct: u8) -> Result<(), MixError> {
    if pct > 100 {
        return Err(MixError::Percentage {
            what,
            got: u32::from(pct),
        });
    }
    Ok(())
}

/// Keeps the tasks outside `population` in place and replaces each one
/// inside it by a draw: from the population's `class` with probability
/// `pct`%, otherwise from the rest of the population.
fn redraw(
    tasks: &[TraceTask],
    pct: u8,
    class_name: &'static str,
    population: impl Fn(&TraceTask) -> bool,
    class: impl Fn(&TraceTask) -> bool,
    change: MixChange,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<TraceTask>, MixError> {
    check_percentage("the percentage", pct)?;
    let inside: Vec<&TraceTask> = tasks
        .iter()
        .filter(|task| population(task) && class(task))
        .collect();
    let outside: Vec<&TraceTask> = tasks
        .iter()
        .filter(|task| population(task) && !class(task))
        .collect();
    let need = |list: &[&TraceTask], missing: &'static str, wanted: bool| {
        if wanted && list.is_empty() {
            Err(MixError::NothingToDraw {
                missing,
                change: change.to_string(),
            })
        } else {
            Ok(())
        }
    };
    need(&inside, class_tasks(class_name, true), pct > 0)?;
    need(&outside, class_tasks(class_name, false), pct < 100)?;
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        if !population(task) {
            out.push(task.clone());
            continue;
        }
        let from = if rng.random_range(0..100u32) < u32::from(pct) {
            &inside
        } else {
            &outside
        };
        out.push(from[rng.random_range(0..from.len())].clone());
    }
    Ok(out)
}

fn class_tasks(class: &'static str, inside: bool) -> &'static str {
    match (class, inside) {
        ("share", true) => "GPU-sharing tasks",
        ("share", false) => "whole-GPU tasks",
        ("multi-GPU", true) => "multi-GPU tasks",
        ("multi-GPU", false) => "single-GPU tasks",
        ("CPU-only", true) => "CPU-only tasks",
        _ => "GPU tasks",
    }
}

fn draw_model(
    nodes: &[NodeSpec],
    task: &TraceTask,
    rng: &mut ChaCha8Rng,
) -> Result<GpuModel, MixError> {
    let wanted = task.gpus.gpu_count();
    let fitting = || {
        nodes
            .iter()
            .filter(move |node| node.gpus.len() as u32 >= wanted)
    };
    let total: usize = fitting().map(|node| node.gpus.len()).sum();
    if total == 0 {
        return Err(MixError::NoNodeFor {
            task: task.name.clone(),
            gpus: wanted,
        });
    }
    let mut pick = rng.random_range(0..total);
    for node in fitting() {
        if pick < node.gpus.len() {
            return Ok(node.gpus[pick].model.clone());
        }
        pick -= node.gpus.len();
    }
    unreachable!("pick is below the total GPU count")
}

/// `tasks` as an openb pod list (`name,cpu_milli,memory_mib,num_gpu,
/// gpu_milli,gpu_spec`), which [`crate::parse_openb_tasks`] reads back.
pub fn write_openb_tasks(tasks: &[TraceTask]) -> String {
    let mut text = String::from("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n");
    for task in tasks {
        let (count, share) = match task.gpus {
            GpuRequest::Whole(0) => (0, 0),
            GpuRequest::Shared(share) => (1, share.0),
            GpuRequest::Whole(count) => (count, 1000),
        };
        let models: Vec<&str> = task.gpu_models.iter().map(GpuModel::as_str).collect();
        text.push_str(&format!(
            "{},{},{},{},{},{}\n",
            task.name,
            task.cpu.0,
            task.memory.0,
            count,
            share,
            models.join("|")
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_openb_nodes, parse_openb_tasks};

    const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n\
        a,64000,262144,2,P100\n\
        b,96000,262144,8,G2\n";

    fn tasks() -> Vec<TraceTask> {
        let text = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
            cpu,4000,1024,0,0,\n\
            share,6000,2048,1,500,\n\
            one,8000,4096,1,1000,\n\
            four,32000,8192,4,1000,\n";
        parse_openb_tasks(text, "t.csv").unwrap()
    }

    fn nodes() -> Vec<NodeSpec> {
        parse_openb_nodes(NODES, "n.csv")
            .unwrap()
            .into_iter()
            .map(|node| node.spec)
            .collect()
    }

    fn many(times: usize) -> Vec<TraceTask> {
        (0..times).flat_map(|_| tasks()).collect()
    }

    fn share_of(tasks: &[TraceTask], class: impl Fn(&TraceTask) -> bool) -> f64 {
        let gpu: Vec<_> = tasks.iter().filter(|t| is_gpu(t)).collect();
        gpu.iter().filter(|t| class(t)).count() as f64 / gpu.len() as f64
    }

    #[test]
    fn share_mix_hits_the_fraction_and_keeps_cpu_only_tasks() {
        let base = many(1000);
        let mixed = resample(&base, &nodes(), MixChange::Share(80), 1).unwrap();
        assert_eq!(mixed.len(), base.len());
        let cpu_only = mixed.iter().filter(|t| !is_gpu(t)).count();
        assert_eq!(cpu_only, 1000, "CPU-only tasks are kept");
        let share = share_of(&mixed, is_share);
        assert!((share - 0.8).abs() < 0.02, "{share}");
        let all = resample(&base, &nodes(), MixChange::Share(100), 1).unwrap();
        assert_eq!(share_of(&all, is_share), 1.0);
        let none = resample(&base, &nodes(), MixChange::Share(0), 1).unwrap();
        assert_eq!(share_of(&none, is_share), 0.0);
    }

    #[test]
    fn multi_gpu_and_cpu_only_mixes() {
        let base = many(1000);
        let multi = resample(&base, &nodes(), MixChange::MultiGpu(50), 2).unwrap();
        assert!((share_of(&multi, is_multi) - 0.5).abs() < 0.03);
        let cpu = resample(&base, &nodes(), MixChange::CpuOnly(60), 2).unwrap();
        let fraction = cpu.iter().filter(|t| !is_gpu(t)).count() as f64 / cpu.len() as f64;
        assert!((fraction - 0.6).abs() < 0.02, "{fraction}");
    }

    #[test]
    fn gpu_spec_picks_models_of_nodes_that_fit() {
        let base = many(500);
        let mixed = resample(&base, &nodes(), MixChange::GpuSpec(100), 3).unwrap();
        for task in mixed.iter().filter(|t| is_gpu(t)) {
            assert_eq!(task.gpu_models.len(), 1);
            if task.gpus.gpu_count() == 4 {
                // Only node b has 4 GPUs.
                assert_eq!(task.gpu_models[0].as_str(), "G2");
            }
        }
        // One-GPU tasks draw P100 with 2 / 10 of the GPUs.
        let single: Vec<_> = mixed
            .iter()
            .filter(|t| t.gpus == GpuRequest::Whole(1))
            .collect();
        let p100 = single
            .iter()
            .filter(|t| t.gpu_models[0].as_str() == "P100")
            .count() as f64
            / single.len() as f64;
        assert!((p100 - 0.2).abs() < 0.04, "{p100}");
        assert!(
            mixed
                .iter()
                .filter(|t| !is_gpu(t))
                .all(|t| t.gpu_models.is_empty())
        );
    }

    #[test]
    fn cpu_scale_multiplies_every_request() {
        let mixed = resample(&tasks(), &nodes(), MixChange::CpuScale(150), 0).unwrap();
        let cpus: Vec<u64> = mixed.iter().map(|t| t.cpu.0).collect();
        assert_eq!(cpus, [6000, 9000, 12000, 48000]);
    }

    #[test]
    fn written_lists_read_back_and_are_deterministic() {
        let base = many(50);
        let first = resample(&base, &nodes(), MixChange::GpuSpec(40), 9).unwrap();
        let again = resample(&base, &nodes(), MixChange::GpuSpec(40), 9).unwrap();
        assert_eq!(first, again);
        let other = resample(&base, &nodes(), MixChange::GpuSpec(40), 10).unwrap();
        assert_ne!(first, other);
        let text = write_openb_tasks(&first);
        assert_eq!(parse_openb_tasks(&text, "mix.csv").unwrap(), first);
    }

    #[test]
    fn impossible_mixes_are_clear_errors() {
        let gpu_only: Vec<_> = tasks().into_iter().filter(is_gpu).collect();
        let error = resample(&gpu_only, &nodes(), MixChange::CpuOnly(10), 0).unwrap_err();
        assert!(error.to_string().contains("no CPU-only tasks"), "{error}");
        let whole: Vec<_> = tasks().into_iter().filter(|t| !is_share(t)).collect();
        let error = resample(&whole, &nodes(), MixChange::Share(30), 0).unwrap_err();
        assert!(
            error.to_string().contains("no GPU-sharing tasks"),
            "{error}"
        );
        assert!(resample(&whole, &nodes(), MixChange::Share(0), 0).is_ok());
        let error = resample(&tasks(), &nodes(), MixChange::Share(101), 0).unwrap_err();
        assert!(error.to_string().contains("0 to 100"), "{error}");
        let small: Vec<NodeSpec> = nodes().into_iter().take(1).collect();
        let error = resample(&tasks(), &small, MixChange::GpuSpec(100), 0).unwrap_err();
        assert!(error.to_string().contains("no node has 4 GPUs"), "{error}");
        assert!(resample(&tasks(), &nodes(), MixChange::CpuScale(0), 0).is_err());
    }
}
