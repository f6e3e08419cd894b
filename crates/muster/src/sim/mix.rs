//! `muster sim mix`: writes another task mix built from a pod list.

use super::{read_openb_nodes, read_openb_tasks, write};
use crate::cli::MixArgs;
use muster_sim::{MixChange, resample, write_openb_tasks};

pub fn run(args: &MixArgs) -> anyhow::Result<()> {
    let change = if let Some(pct) = args.share {
        MixChange::Share(pct)
    } else if let Some(pct) = args.multi_gpu {
        MixChange::MultiGpu(pct)
    } else if let Some(pct) = args.cpu_only {
        MixChange::CpuOnly(pct)
    } else if let Some(pct) = args.gpu_spec {
        MixChange::GpuSpec(pct)
    } else if let Some(pct) = args.cpu_scale {
        MixChange::CpuScale(pct)
    } else {
        anyhow::bail!(
            "say what to change: --share, --multi-gpu, --cpu-only, --gpu-spec or --cpu-scale"
        );
    };
    let tasks = read_openb_tasks(&args.files.tasks)?;
    let nodes = match change {
        MixChange::GpuSpec(_) => read_openb_nodes(&args.files.nodes)?
            .into_iter()
            .map(|node| node.spec)
            .collect(),
        _ => Vec::new(),
    };
    let mixed = resample(&tasks, &nodes, change, args.seed)?;
    write(&args.out, &write_openb_tasks(&mixed))?;
    eprintln!(
        "wrote {} ({} tasks; {change}; seed {})",
        args.out.display(),
        mixed.len(),
        args.seed
    );
    Ok(())
}
