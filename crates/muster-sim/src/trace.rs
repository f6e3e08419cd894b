//! The Alibaba GPU cluster trace v2023 ("openb") files: the node list
//! (`sn,cpu_milli,memory_mib,gpu,model`) and the pod lists
//! (`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`).
//!
//! Columns are found by their header name, so extra columns and other orders
//! are accepted. Every malformed row is an error naming the file, the line,
//! the column, the value and what was expected.

use muster_model::{CpuMilli, GpuModel, GpuRequest, GpuSpec, MemoryMib, NodeName, NodeSpec};
use muster_model::{PoolName, RackName};
use muster_sched::{ClusterState, NodeInput, TaskRequest, TaskShape};
use std::collections::BTreeMap;

/// The pool every trace node is put in.
pub const TRACE_POOL: &str = "default";
/// The rack every trace node is put in (the traces have no topology).
pub const TRACE_RACK: &str = "rack-0";
/// The most GPUs a node (or a task) may have.
pub const MAX_GPUS: u32 = 64;

/// Error reading a trace file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("{file}: the file is empty; expected a header line with {expected}")]
    Empty { file: String, expected: String },
    #[error("{file}:1: missing column {column}; the header has: {header}")]
    MissingColumn {
        file: String,
        column: &'static str,
        header: String,
    },
    #[error(
        "{file}:{line}: expected {expected} comma-separated fields as in the header, got {got}"
    )]
    FieldCount {
        file: String,
        line: usize,
        expected: usize,
        got: usize,
    },
    #[error("{file}:{line}: column {column}: expected {expected}, got {value:?}")]
    Field {
        file: String,
        line: usize,
        column: &'static str,
        value: String,
        expected: String,
    },
    #[error("{file}:{line}: node {name} already appears on line {first_line}")]
    DuplicateNode {
        file: String,
        line: usize,
        name: String,
        first_line: usize,
    },
    #[error("{file}: no rows after the header")]
    NoRows { file: String },
}

/// One task of a pod list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceTask {
    pub name: String,
    pub gpus: GpuRequest,
    pub cpu: CpuMilli,
    pub memory: MemoryMib,
    /// Allowed GPU models; empty: any.
    pub gpu_models: Vec<GpuModel>,
}

impl TraceTask {
    /// The task's GPU request in thousandths of a GPU (count x share).
    pub fn gpu_milli(&self) -> u64 {
        u64::from(self.gpus.total().0)
    }

    /// The task as the scheduler sees it, with models interned against
    /// `cluster` (models the cluster lacks are left out of the mask).
    pub fn shape(&self, cluster: &mut ClusterState) -> TaskShape {
        self.request().shape(cluster)
    }

    /// The task as a request: any pool, no GPU memory floor.
    pub fn request(&self) -> TaskRequest {
        TaskRequest {
            container: false,
            gpus: self.gpus,
            cpu: self.cpu,
            memory: self.memory,
            gpu_models: self.gpu_models.clone(),
            min_gpu_memory: None,
            pool: None,
            reserved: Default::default(),
        }
    }
}

/// A CSV text with its header, split into fields (the traces quote nothing).
pub(crate) struct Table<'a> {
    pub(crate) file: &'a str,
    columns: Vec<&'a str>,
    /// (1-based line number, fields)
    pub(crate) rows: Vec<(usize, Vec<&'a str>)>,
}

impl<'a> Table<'a> {
    pub(crate) fn parse(text: &'a str, file: &'a str, expected: &str) -> Result<Self, TraceError> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(index, line)| (index + 1, line))
            .filter(|(_, line)| !line.trim().is_empty());
        let Some((_, header)) = lines.next() else {
            return Err(TraceError::Empty {
                file: file.to_string(),
                expected: expected.to_string(),
            });
        };
        let header = header.strip_prefix('\u{feff}').unwrap_or(header);
        let columns: Vec<&str> = header.split(',').map(str::trim).collect();
        let mut rows = Vec::new();
        for (line, text) in lines {
            let fields: Vec<&str> = text.split(',').map(str::trim).collect();
            if fields.len() != columns.len() {
                return Err(TraceError::FieldCount {
                    file: file.to_string(),
                    line,
                    expected: columns.len(),
                    got: fields.len(),
                });
            }
            rows.push((line, fields));
        }
        if rows.is_empty() {
            return Err(TraceError::NoRows {
                file: file.to_string(),
            });
        }
        Ok(Table {
            file,
            columns,
            rows,
        })
    }

    pub(crate) fn column(&self, name: &'static str) -> Result<Column, TraceError> {
        self.optional_column(name)
            .ok_or_else(|| TraceError::MissingColumn {
                file: self.file.to_string(),
                column: name,
                header: self.columns.join(","),
            })
    }

    pub(crate) fn optional_column(&self, name: &'static str) -> Option<Column> {
        self.columns
            .iter()
            .position(|column| *column == name)
            .map(|index| Column { name, index })
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Column {
    name: &'static str,
    index: usize,
}

/// One row being read, for errors that name the line and column.
pub(crate) struct Row<'a, 'b> {
    pub(crate) file: &'a str,
    pub(crate) line: usize,
    pub(crate) fields: &'b [&'a str],
}

impl<'a> Row<'a, '_> {
    pub(crate) fn text(&self, column: Column) -> &'a str {
        self.fields.get(column.index).copied().unwrap_or("")
    }

    pub(crate) fn error(&self, column: Column, expected: impl Into<String>) -> TraceError {
        TraceError::Field {
            file: self.file.to_string(),
            line: self.line,
            column: column.name,
            value: self.text(column).to_string(),
            expected: expected.into(),
        }
    }

    pub(crate) fn integer(
        &self,
        column: Column,
        range: std::ops::RangeInclusive<u64>,
    ) -> Result<u64, TraceError> {
        match self.text(column).parse::<u64>() {
            Ok(value) if range.contains(&value) => Ok(value),
            _ if *range.end() == u64::MAX => Err(self.error(column, "a non-negative integer")),
            _ => Err(self.error(
                column,
                format!("an integer {}..={}", range.start(), range.end()),
            )),
        }
    }
}

/// Parses an openb node list (`sn,cpu_milli,memory_mib,gpu,model`) into
/// schedulable nodes: `gpu` GPUs of `model` each (GPU memory unknown: 0), one
/// NVLink domain, pool `default`, rack `rack-0`. `file_name` is used in
/// errors only.
pub fn parse_openb_nodes(text: &str, file_name: &str) -> Result<Vec<NodeInput>, TraceError> {
    let table = Table::parse(text, file_name, "sn,cpu_milli,memory_mib,gpu,model")?;
    let name = table.column("sn")?;
    let cpu = table.column("cpu_milli")?;
    let memory = table.column("memory_mib")?;
    let gpu = table.column("gpu")?;
    let model = table.column("model")?;
    let mut first_line: BTreeMap<&str, usize> = BTreeMap::new();
    let mut nodes = Vec::with_capacity(table.rows.len());
    for (line, fields) in &table.rows {
        let row = Row {
            file: file_name,
            line: *line,
            fields,
        };
        let node_name = row.text(name);
        if node_name.is_empty() {
            return Err(row.error(name, "a node name"));
        }
        if let Some(&first) = first_line.get(node_name) {
            return Err(TraceError::DuplicateNode {
                file: file_name.to_string(),
                line: *line,
                name: node_name.to_string(),
                first_line: first,
            });
        }
        first_line.insert(node_name, *line);
        let cpu_milli = row.integer(cpu, 0..=u64::MAX)?;
        let memory_mib = row.integer(memory, 0..=u64::MAX)?;
        let gpu_count = row.integer(gpu, 0..=u64::from(MAX_GPUS))? as u32;
        let model_name = row.text(model);
        if gpu_count > 0 && model_name.is_empty() {
            return Err(row.error(model, "a GPU model name (the node has GPUs)"));
        }
        let gpu_model = GpuModel::new(model_name);
        let gpus = (0..gpu_count)
            .map(|index| GpuSpec {
                index,
                uuid: format!("{node_name}-gpu-{index}"),
                model: gpu_model.clone(),
                memory: MemoryMib(0),
                nvlink_domain: 0,
            })
            .collect();
        nodes.push(NodeInput::schedulable(NodeSpec {
            name: NodeName::from(node_name),
            pool: PoolName::from(TRACE_POOL),
            rack: RackName::from(TRACE_RACK),
            gpus,
            cpu: CpuMilli(cpu_milli),
            memory: MemoryMib(memory_mib),
        }));
    }
    Ok(nodes)
}

/// Parses an openb pod list (`name,cpu_milli,memory_mib,num_gpu,gpu_milli`,
/// and optionally `gpu_spec`; other columns are ignored). `num_gpu` 0 is a
/// CPU-only task; `gpu_milli` is per GPU, below 1000 only with `num_gpu` 1;
/// `gpu_spec` lists the allowed models, `|`-separated, empty for any.
/// `file_name` is used in errors only.
pub fn parse_openb_tasks(text: &str, file_name: &str) -> Result<Vec<TraceTask>, TraceError> {
    let table = Table::parse(
        text,
        file_name,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec]",
    )?;
    let name = table.column("name")?;
    let cpu = table.column("cpu_milli")?;
    let memory = table.column("memory_mib")?;
    let num_gpu = table.column("num_gpu")?;
    let gpu_milli = table.column("gpu_milli")?;
    let gpu_spec = table.optional_column("gpu_spec");
    let mut tasks = Vec::with_capacity(table.rows.len());
    for (line, fields) in &table.rows {
        let row = Row {
            file: file_name,
            line: *line,
            fields,
        };
        let cpu_milli = row.integer(cpu, 0..=u64::MAX)?;
        let memory_mib = row.integer(memory, 0..=u64::MAX)?;
        let count = row.integer(num_gpu, 0..=u64::from(MAX_GPUS))? as u32;
        let share = row.integer(gpu_milli, 0..=1000)? as u32;
        let gpus = match GpuRequest::from_count_and_share(count, share) {
            Some(gpus) => gpus,
            None if share == 0 => {
                return Err(row.error(gpu_milli, "an integer 1..=1000 when num_gpu is above 0"));
            }
            None => {
                return Err(row.error(
                    gpu_milli,
                    format!("1000 when num_gpu is {count} (a share below 1000 is of one GPU only)"),
                ));
            }
        };
        let gpu_models = gpu_spec
            .map(|column| {
                row.text(column)
                    .split('|')
                    .map(str::trim)
                    .filter(|model| !model.is_empty())
                    .map(GpuModel::new)
                    .collect()
            })
            .unwrap_or_default();
        tasks.push(TraceTask {
            name: row.text(name).to_string(),
            gpus,
            cpu: CpuMilli(cpu_milli),
            memory: MemoryMib(memory_mib),
            gpu_models,
        });
    }
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_model::GpuMilli;

    const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n\
                         node-b,64000,262144,2,P100\n\
                         node-a,96000,393216,8,G2\n\
                         cpu-node,32000,65536,0,\n";

    #[test]
    fn nodes_get_their_gpus_cpu_and_memory() {
        let nodes = parse_openb_nodes(NODES, "nodes.csv").unwrap();
        assert_eq!(nodes.len(), 3);
        let spec = &nodes[0].spec;
        assert_eq!(spec.name, NodeName::from("node-b"));
        assert_eq!(spec.cpu, CpuMilli(64_000));
        assert_eq!(spec.memory, MemoryMib(262_144));
        assert_eq!(spec.gpus.len(), 2);
        assert!(
            spec.gpus
                .iter()
                .all(|gpu| gpu.model == GpuModel::new("P100"))
        );
        assert_eq!(spec.pool, PoolName::from("default"));
        assert_eq!(nodes[1].spec.gpus.len(), 8);
        assert!(nodes[2].spec.gpus.is_empty());
        let cluster = ClusterState::new(nodes).unwrap();
        assert_eq!(cluster.gpu_capacity_milli(), 10_000);
    }

    #[test]
    fn columns_are_found_by_name_in_any_order() {
        let text = "model,gpu,sn,memory_mib,cpu_milli,extra\nT4,2,n1,1024,8000,x\n";
        let nodes = parse_openb_nodes(text, "nodes.csv").unwrap();
        assert_eq!(nodes[0].spec.gpus.len(), 2);
        assert_eq!(nodes[0].spec.cpu, CpuMilli(8000));
    }

    #[test]
    fn tasks_read_count_share_and_models() {
        let text = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n\
                    p0,12000,16384,1,1000,,LS\n\
                    p1,6000,12288,1,460,V100M16|V100M32,LS\n\
                    p2,8000,30517,0,0,,BE\n\
                    p3,32000,65536,8,1000,,LS\n";
        let tasks = parse_openb_tasks(text, "pods.csv").unwrap();
        assert_eq!(tasks.len(), 4);
        assert_eq!(tasks[0].gpus, GpuRequest::Whole(1));
        assert_eq!(tasks[1].gpus, GpuRequest::Shared(GpuMilli(460)));
        assert_eq!(
            tasks[1].gpu_models,
            vec![GpuModel::new("V100M16"), GpuModel::new("V100M32")]
        );
        assert_eq!(tasks[2].gpus, GpuRequest::Whole(0));
        assert_eq!(tasks[2].gpu_milli(), 0);
        assert_eq!(tasks[3].gpu_milli(), 8000);
        assert_eq!(tasks[3].cpu, CpuMilli(32_000));
    }

    #[test]
    fn the_gpu_spec_column_is_optional() {
        let text = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,2,1000\n";
        let tasks = parse_openb_tasks(text, "multigpu50.csv").unwrap();
        assert_eq!(tasks[0].gpus, GpuRequest::Whole(2));
        assert!(tasks[0].gpu_models.is_empty());
    }

    #[test]
    fn models_outside_the_cluster_fit_nowhere_and_empty_fits_any() {
        let mut cluster =
            ClusterState::new(parse_openb_nodes(NODES, "nodes.csv").unwrap()).unwrap();
        let mut task = TraceTask {
            name: "p".into(),
            gpus: GpuRequest::Whole(1),
            cpu: CpuMilli(1),
            memory: MemoryMib(1),
            gpu_models: vec![],
        };
        assert_eq!(
            task.shape(&mut cluster).models,
            muster_sched::ModelMask::ANY
        );
        task.gpu_models = vec![GpuModel::new("A100")];
        assert_eq!(task.shape(&mut cluster).models, muster_sched::ModelMask(0));
    }

    fn task_error(rows: &str) -> String {
        let text = format!("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n{rows}");
        parse_openb_tasks(&text, "openb_pod_list_default.csv")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_bad_share_names_file_line_column_value_and_expectation() {
        assert_eq!(
            task_error("p0,1000,1024,1,1000,\np1,1000,1024,1,abc,\n"),
            "openb_pod_list_default.csv:3: column gpu_milli: expected an integer 0..=1000, got \"abc\""
        );
        assert_eq!(
            task_error("p0,1000,1024,1,1001,\n"),
            "openb_pod_list_default.csv:2: column gpu_milli: expected an integer 0..=1000, got \"1001\""
        );
    }

    #[test]
    fn a_share_of_several_gpus_is_rejected() {
        assert_eq!(
            task_error("p0,1000,1024,2,500,\n"),
            "openb_pod_list_default.csv:2: column gpu_milli: expected 1000 when num_gpu is 2 \
             (a share below 1000 is of one GPU only), got \"500\""
        );
        assert_eq!(
            task_error("p0,1000,1024,1,0,\n"),
            "openb_pod_list_default.csv:2: column gpu_milli: expected an integer 1..=1000 \
             when num_gpu is above 0, got \"0\""
        );
    }

    #[test]
    fn other_bad_fields_are_named() {
        assert_eq!(
            task_error("p0,-5,1024,1,1000,\n"),
            "openb_pod_list_default.csv:2: column cpu_milli: expected a non-negative integer, got \"-5\""
        );
        assert_eq!(
            task_error("p0,1000,1024,65,1000,\n"),
            "openb_pod_list_default.csv:2: column num_gpu: expected an integer 0..=64, got \"65\""
        );
        assert_eq!(
            task_error("p0,1000,1024,1\n"),
            "openb_pod_list_default.csv:2: expected 6 comma-separated fields as in the header, got 4"
        );
    }

    #[test]
    fn missing_columns_empty_files_and_duplicates_are_errors() {
        let error = parse_openb_tasks("name,cpu_milli,memory_mib,num_gpu\np,1,1,0\n", "pods.csv")
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "pods.csv:1: missing column gpu_milli; the header has: name,cpu_milli,memory_mib,num_gpu"
        );
        assert!(matches!(
            parse_openb_tasks("", "pods.csv"),
            Err(TraceError::Empty { .. })
        ));
        assert_eq!(
            parse_openb_tasks("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "pods.csv")
                .unwrap_err()
                .to_string(),
            "pods.csv: no rows after the header"
        );
        let error = parse_openb_nodes(
            "sn,cpu_milli,memory_mib,gpu,model\nn1,1,1,1,T4\nn1,1,1,1,T4\n",
            "nodes.csv",
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "nodes.csv:3: node n1 already appears on line 2"
        );
        let error = parse_openb_nodes(
            "sn,cpu_milli,memory_mib,gpu,model\nn1,1,1,2,\n",
            "nodes.csv",
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "nodes.csv:2: column model: expected a GPU model name (the node has GPUs), got \"\""
        );
    }

    #[test]
    fn windows_line_ends_and_blank_lines_are_accepted() {
        let text =
            "\u{feff}name,cpu_milli,memory_mib,num_gpu,gpu_milli\r\n\r\np0,1000,1024,1,250\r\n";
        let tasks = parse_openb_tasks(text, "pods.csv").unwrap();
        assert_eq!(tasks[0].gpus, GpuRequest::Shared(GpuMilli(250)));
    }
}
