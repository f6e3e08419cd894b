//! `muster-supervise supervise STATE_DIR KEY`: the task supervisor alone,
//! for the runtime's tests; `muster supervise` runs the same code.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("task-init") {
        std::process::exit(muster_agent::taskinit::entry(&args[1..]));
    }
    if args.first().map(String::as_str) == Some("container-task") {
        std::process::exit(muster_agent::container::main(&args[1..]));
    }
    let args = match args.split_first() {
        Some((first, rest)) if first == "supervise" => rest.to_vec(),
        _ => args,
    };
    std::process::exit(muster_agent::supervise::main(&args));
}
