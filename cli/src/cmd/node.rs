//! `sbx node …`: NodeService, for a gateway-wide admin — the machines sandboxes run on
//! (`sbxd node` hosts; the gateway's own drivers are the node `local`).

use std::collections::BTreeMap;
use std::time::SystemTime;

use clap::{Args, Subcommand};
use sbx_proto::v1::node_service_client::NodeServiceClient;
use sbx_proto::v1::{
    AddNodeRequest, CordonNodeRequest, DrainNodeRequest, GetNodeRequest, ListNodesRequest, Node,
    NodeCapacity, NodeRef, RemoveNodeRequest,
};
use serde::Serialize;

use crate::CliError;
use crate::args::{parse_key_value, parse_name};
use crate::connect::{Target, connect};
use crate::output::{
    DeletedView, OutputArgs, OutputFormat, Style, age, camel_case_enum, human_bytes,
    render_deleted, render_list, render_structured, render_table, rfc3339,
};
use crate::reply::print;

/// `sbx node …`
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Register the node whose `sbxd node --listen` answers at --address: the gateway asks
    /// it what it is (its id, drivers, capacity) and refuses an address where none answers.
    Add(NodeAddArgs),
    /// Every node, `local` (the gateway's own drivers) first: state, cordon, drivers, what
    /// its sandboxes ask of it against its capacity.
    #[command(visible_alias = "ls")]
    List(NodeListArgs),
    /// One node.
    Get(NodeNameArgs),
    /// Give the node no new sandbox; those it holds go on.
    Cordon(NodeNameArgs),
    /// Let the node take new sandboxes again.
    Uncordon(NodeNameArgs),
    /// Cordon the node, then stop its sandboxes (`--stop`) or say how many still run.
    /// Sandboxes are never moved: their files are on the node.
    Drain(NodeDrainArgs),
    /// Forget a node that holds no sandbox.
    #[command(visible_alias = "rm")]
    Remove(NodeNameArgs),
}

#[derive(Debug, Args)]
pub struct NodeAddArgs {
    /// Its name among the nodes (a DNS-1123 label; not "local").
    #[arg(value_parser = parse_name)]
    pub name: String,
    /// HOST:PORT of its `sbxd node --listen`, as the gateway reaches it (`--endpoint` is the
    /// gateway's own address, as for every command).
    #[arg(long, value_name = "HOST:PORT")]
    pub address: String,
    /// A label (KEY=VALUE) that `sbx sandbox create --node-selector` matches; repeat.
    #[arg(long = "label", short = 'l', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub labels: Vec<(String, String)>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct NodeListArgs {
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct NodeNameArgs {
    /// The node's name (or, with --id, its id).
    pub name: String,
    /// NAME is the node's id.
    #[arg(long)]
    pub id: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct NodeDrainArgs {
    #[command(flatten)]
    pub node: NodeNameArgs,
    /// Stop every sandbox on the node (else only cordon it and count what runs).
    #[arg(long)]
    pub stop: bool,
}

/// A node as printed in JSON and YAML.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeView {
    pub id: String,
    pub name: String,
    pub endpoint: String,
    pub state: String,
    pub message: String,
    pub cordoned: bool,
    pub drivers: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub capacity: CapacityView,
    pub allocated: CapacityView,
    pub last_seen: Option<String>,
    pub created_at: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityView {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    pub sandboxes: u32,
}

fn capacity(c: Option<&NodeCapacity>) -> CapacityView {
    let c = c.copied().unwrap_or_default();
    CapacityView {
        cpu_millis: c.cpu_millis,
        memory_bytes: c.memory_bytes,
        disk_bytes: c.disk_bytes,
        sandboxes: c.max_sandboxes,
    }
}

fn view(n: &Node) -> NodeView {
    NodeView {
        id: n.id.clone(),
        name: n.name.clone(),
        endpoint: n.endpoint.clone(),
        state: camel_case_enum(n.state().as_str_name(), "NODE_STATE_"),
        message: n.message.clone(),
        cordoned: n.cordoned,
        drivers: n.drivers.clone(),
        labels: n.labels.clone().into_iter().collect(),
        capacity: capacity(n.capacity.as_ref()),
        allocated: capacity(n.allocated.as_ref()),
        last_seen: rfc3339(n.last_seen.as_ref()),
        created_at: rfc3339(n.created_at.as_ref()),
    }
}

/// `used/of` of a figure, `of` "-" when the node sets no bound.
fn share(used: u64, of: u64, show: impl Fn(u64) -> String) -> String {
    if of == 0 {
        format!("{}/-", show(used))
    } else {
        format!("{}/{}", show(used), show(of))
    }
}

fn table(nodes: &[Node], style: Style) -> String {
    let now = SystemTime::now();
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let v = view(n);
            vec![
                n.name.clone(),
                v.state,
                if n.cordoned { "yes" } else { "no" }.into(),
                n.drivers.join(","),
                share(
                    u64::from(v.allocated.sandboxes),
                    u64::from(v.capacity.sandboxes),
                    |n| n.to_string(),
                ),
                share(v.allocated.cpu_millis, v.capacity.cpu_millis, |m| {
                    format!("{m}m")
                }),
                share(
                    v.allocated.memory_bytes,
                    v.capacity.memory_bytes,
                    human_bytes,
                ),
                if n.endpoint.is_empty() {
                    "-".into()
                } else {
                    n.endpoint.clone()
                },
                if n.created_at.is_some() {
                    age(now, n.created_at.as_ref())
                } else {
                    "-".into()
                },
            ]
        })
        .collect();
    render_table(
        &[
            "NAME",
            "STATE",
            "CORDONED",
            "DRIVERS",
            "SANDBOXES",
            "CPU",
            "MEMORY",
            "ENDPOINT",
            "AGE",
        ],
        &rows,
        style,
    )
}

fn render_node(style: Style, node: &Node) -> Result<String, CliError> {
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, &view(node)),
        OutputFormat::Name => Ok(format!("node/{}\n", node.name)),
        OutputFormat::Table | OutputFormat::Wide => {
            let mut out = table(std::slice::from_ref(node), style);
            if !node.message.is_empty() && style.headers {
                out.push_str(&format!("MESSAGE: {}\n", node.message));
            }
            Ok(out)
        }
    }
}

fn node_ref(args: &NodeNameArgs) -> Option<NodeRef> {
    Some(if args.id {
        NodeRef {
            id: args.name.clone(),
            ..Default::default()
        }
    } else {
        NodeRef {
            name: args.name.clone(),
            ..Default::default()
        }
    })
}

pub async fn run_node(target: &Target, cmd: NodeCommand) -> Result<u8, CliError> {
    let mut client = NodeServiceClient::new(connect(target).await?);
    match cmd {
        NodeCommand::Add(args) => {
            let node = client
                .add_node(AddNodeRequest {
                    name: args.name,
                    endpoint: args.address,
                    labels: args.labels.into_iter().collect(),
                })
                .await?
                .into_inner();
            print(&render_node((&args.output).into(), &node)?)?;
        }
        NodeCommand::List(args) => {
            let nodes = client
                .list_nodes(ListNodesRequest {})
                .await?
                .into_inner()
                .nodes;
            let style: Style = (&args.output).into();
            print(&render_list(
                style,
                &nodes,
                ("node", |n: &Node| n.name.as_str()),
                |rows| table(rows, style),
                view,
            )?)?;
        }
        NodeCommand::Get(args) => {
            let node = client
                .get_node(GetNodeRequest {
                    node: node_ref(&args),
                })
                .await?
                .into_inner();
            print(&render_node((&args.output).into(), &node)?)?;
        }
        NodeCommand::Cordon(args) => {
            let node = client
                .cordon_node(CordonNodeRequest {
                    node: node_ref(&args),
                    cordon: true,
                })
                .await?
                .into_inner();
            print(&render_node((&args.output).into(), &node)?)?;
        }
        NodeCommand::Uncordon(args) => {
            let node = client
                .cordon_node(CordonNodeRequest {
                    node: node_ref(&args),
                    cordon: false,
                })
                .await?
                .into_inner();
            print(&render_node((&args.output).into(), &node)?)?;
        }
        NodeCommand::Drain(args) => {
            let drained = client
                .drain_node(DrainNodeRequest {
                    node: node_ref(&args.node),
                    stop: args.stop,
                })
                .await?
                .into_inner();
            eprintln!(
                "node {} cordoned; {} sandbox(es) stopped now, {} still running",
                args.node.name, drained.stopped, drained.running
            );
            if let Some(node) = &drained.node {
                print(&render_node((&args.node.output).into(), node)?)?;
            }
        }
        NodeCommand::Remove(args) => {
            let removed = client
                .remove_node(RemoveNodeRequest {
                    node: node_ref(&args),
                })
                .await?
                .into_inner()
                .removed;
            let deleted = DeletedView {
                deleted: removed,
                id: None,
            };
            print(&render_deleted(
                &args.output,
                &deleted,
                &format!("node {:?}", args.name),
                &format!("node/{}", args.name),
            )?)?;
        }
    }
    Ok(0)
}
