//! `tessera binder`: lists each claim whose device the scheduler waits on
//! (binding conditions) for its node to make ahead.

use std::time::Duration;

use tessera_controller::binder::{self, BinderConfig};

use crate::flags::{DriverFlags, KubeFlags, init_logging};
use crate::signals::termination;

#[derive(Debug, Clone, clap::Args)]
pub struct BinderArgs {
    #[command(flatten)]
    pub driver: DriverFlags,

    #[command(flatten)]
    pub kube: KubeFlags,

    /// Where the nodes read their listings (the node processes'
    /// --binding-namespace): the driver's namespace.
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: String,
}

/// `tessera binder`.
pub fn main(args: &BinderArgs) -> anyhow::Result<()> {
    init_logging();
    let driver = args.driver.driver()?.as_str().to_owned();
    let runtime = crate::flags::runtime()?;
    runtime.block_on(async {
        let client = args.kube.client(Duration::from_secs(10)).await?;
        let config = BinderConfig {
            driver,
            namespace: args.namespace.clone(),
        };
        tokio::select! {
            ended = binder::run(client, config) => Ok(ended?),
            () = termination() => Ok(()),
        }
    })
}
