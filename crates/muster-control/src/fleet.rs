//! Fleet consistency: each pool's software stack (driver, CUDA, VBIOS,
//! kernel, NCCL, container runtime, ...) as its nodes report it, the most
//! common version of each component, and the nodes that differ from it.

use std::collections::BTreeMap;

/// One node's stack: component name to version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStack<'a> {
    pub node: &'a str,
    pub pool: &'a str,
    pub components: BTreeMap<&'a str, &'a str>,
}

/// What a node reports for a component where its pool's majority differs
/// (`"(none)"` for a component it does not report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    pub node: String,
    pub component: String,
    pub version: String,
    pub expected: String,
}

/// A pool's stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStack {
    pub pool: String,
    pub nodes: usize,
    /// Per component, how many nodes report each version.
    pub versions: BTreeMap<String, BTreeMap<String, usize>>,
    /// Per component, the most common version (ties: the highest).
    pub majority: BTreeMap<String, String>,
    /// Nodes that differ from the majority, by node then component.
    pub drift: Vec<Drift>,
}

/// A node's stack as [`pool_stacks`] reads it.
pub fn node_stack(node: &crate::Node) -> NodeStack<'_> {
    NodeStack {
        node: node.spec.name.0.as_str(),
        pool: node.spec.pool.0.as_str(),
        components: node.software.components(),
    }
}

impl crate::ControlPlane {
    /// Each pool's stack, from the registered nodes.
    pub fn pool_stacks(&self) -> Vec<PoolStack> {
        let nodes: Vec<NodeStack<'_>> = self.nodes().map(node_stack).collect();
        pool_stacks(&nodes)
    }
}

/// What a node reports for a component it lacks.
pub const NONE: &str = "(none)";

/// Each pool's stack, pools by name.
pub fn pool_stacks(nodes: &[NodeStack<'_>]) -> Vec<PoolStack> {
    let mut pools: BTreeMap<&str, Vec<&NodeStack<'_>>> = BTreeMap::new();
    for node in nodes {
        pools.entry(node.pool).or_default().push(node);
    }
    pools
        .into_iter()
        .map(|(pool, members)| {
            let components: std::collections::BTreeSet<&str> = members
                .iter()
                .flat_map(|node| node.components.keys().copied())
                .collect();
            let mut versions: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
            for component in &components {
                let counts = versions.entry((*component).to_string()).or_default();
                for node in &members {
                    let version = node.components.get(component).copied().unwrap_or(NONE);
                    *counts.entry(version.to_string()).or_default() += 1;
                }
            }
            let majority: BTreeMap<String, String> = versions
                .iter()
                .filter_map(|(component, counts)| {
                    // The most nodes; of equals, the highest version.
                    let (version, _) = counts
                        .iter()
                        .max_by(|a, b| a.1.cmp(b.1).then_with(|| a.0.cmp(b.0)))?;
                    Some((component.clone(), version.clone()))
                })
                .collect();
            let mut drift = Vec::new();
            for node in &members {
                for (component, expected) in &majority {
                    let version = node
                        .components
                        .get(component.as_str())
                        .copied()
                        .unwrap_or(NONE);
                    if version != expected {
                        drift.push(Drift {
                            node: node.node.to_string(),
                            component: component.clone(),
                            version: version.to_string(),
                            expected: expected.clone(),
                        });
                    }
                }
            }
            drift.sort_by(|a, b| (&a.node, &a.component).cmp(&(&b.node, &b.component)));
            PoolStack {
                pool: pool.to_string(),
                nodes: members.len(),
                versions,
                majority,
                drift,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node<'a>(name: &'a str, pool: &'a str, pairs: &[(&'a str, &'a str)]) -> NodeStack<'a> {
        NodeStack {
            node: name,
            pool,
            components: pairs.iter().copied().collect(),
        }
    }

    #[test]
    fn the_node_that_differs_from_its_pool_is_named_with_both_versions() {
        let nodes = [
            node("a", "train", &[("driver", "550.90"), ("kernel", "6.1")]),
            node("b", "train", &[("driver", "550.90"), ("kernel", "6.1")]),
            node("c", "train", &[("driver", "550.54"), ("kernel", "6.1")]),
            node("d", "infer", &[("driver", "535.1")]),
        ];
        let pools = pool_stacks(&nodes);
        assert_eq!(pools.len(), 2);
        let infer = &pools[0];
        assert_eq!((infer.pool.as_str(), infer.nodes), ("infer", 1));
        assert!(infer.drift.is_empty());
        let train = &pools[1];
        assert_eq!(train.majority["driver"], "550.90");
        assert_eq!(train.versions["driver"]["550.54"], 1);
        assert_eq!(
            train.drift,
            vec![Drift {
                node: "c".into(),
                component: "driver".into(),
                version: "550.54".into(),
                expected: "550.90".into(),
            }]
        );
    }

    #[test]
    fn a_missing_component_is_drift_and_ties_go_to_the_highest_version() {
        let nodes = [
            node("a", "p", &[("driver", "550.90"), ("nccl", "2.21.5")]),
            node("b", "p", &[("driver", "550.54")]),
        ];
        let pools = pool_stacks(&nodes);
        let pool = &pools[0];
        // One each: the higher version is the reference.
        assert_eq!(pool.majority["driver"], "550.90");
        let drifting: Vec<(&str, &str, &str)> = pool
            .drift
            .iter()
            .map(|d| (d.node.as_str(), d.component.as_str(), d.version.as_str()))
            .collect();
        // nccl: one has 2.21.5, one none: a tie, and "2.21.5" > "(none)".
        assert_eq!(
            drifting,
            vec![("b", "driver", "550.54"), ("b", "nccl", NONE)]
        );
        assert_eq!(pool.majority["nccl"], "2.21.5");
        assert!(pool.versions["nccl"].contains_key(NONE));
        assert!(pool_stacks(&[]).is_empty());
    }
}
