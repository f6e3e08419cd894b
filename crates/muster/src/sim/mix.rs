//! `muster sim mix`: writes another task mix built from a pod list.

use super::{read, write};
use crate::cli::MixArgs;
use muster_sim::{MixChange, parse_openb_nodes, parse_openb_tasks, resample, write_openb_tasks};

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
    let tasks = parse_openb_tasks(&read(&args.tasks)?, &args.tasks.display().to_string())?;
    let nodes = match change {
        MixChange::GpuSpec(_) => {
            parse_openb_nodes(&read(&args.nodes)?, &args.nodes.display().to_string())?
                .into_iter()
                .map(|node| node.spec)
                .collect()
        }
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
