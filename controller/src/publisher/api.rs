//! What the publisher reads from the API server: our slices, the Node
//! that owns them, and the devices allocated claims hold.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Api;
use kube::api::ListParams;

use super::{PublishError, Publisher, held_in};

impl Publisher {
    pub(super) fn slices_api(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }

    pub(super) fn field_selector(&self) -> String {
        format!(
            "spec.nodeName={},spec.driver={}",
            self.config.node, self.config.driver
        )
    }

    /// This driver's slices of this node, by name.
    pub(super) async fn existing(&self) -> Result<Vec<ResourceSlice>, PublishError> {
        let lp = ListParams::default().fields(&self.field_selector());
        self.counters.listed_slices();
        let list = self
            .slices_api()
            .list(&lp)
            .await
            .map_err(|e| PublishError::api("listing our ResourceSlices", e))?;
        let mut slices: Vec<ResourceSlice> = list
            .items
            .into_iter()
            // The field selector already did this; be certain anyway.
            .filter(|s| {
                s.spec.driver == self.config.driver.as_str()
                    && s.spec.node_name.as_deref() == Some(self.config.node.as_str())
            })
            .collect();
        slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        Ok(slices)
    }

    /// The Node as owner of our slices, read from the server (and cached).
    pub(super) async fn fetch_owner(&mut self) -> Result<OwnerReference, PublishError> {
        self.owner = None;
        self.counters.got_node();
        let node = Api::<Node>::all(self.client.clone())
            .get_opt(&self.config.node)
            .await
            .map_err(|e| PublishError::api(format!("reading node {}", self.config.node), e))?
            .ok_or_else(|| PublishError::NodeNotFound(self.config.node.clone()))?;
        let uid = node
            .metadata
            .uid
            .ok_or_else(|| PublishError::NodeNotFound(self.config.node.clone()))?;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.config.node.clone(),
            uid,
            controller: Some(true),
            block_owner_deletion: None,
        };
        self.owner = Some(owner.clone());
        Ok(owner)
    }

    /// Devices of our pool that allocated claims hold, listed (every
    /// claim, paged).
    pub(super) async fn held_devices(&self) -> Result<BTreeSet<String>, PublishError> {
        let api: Api<ResourceClaim> = Api::all(self.client.clone());
        let mut held = BTreeSet::new();
        let mut lp = ListParams::default().limit(500);
        loop {
            self.counters.listed_claims();
            let page = api
                .list(&lp)
                .await
                .map_err(|e| PublishError::api("listing ResourceClaims", e))?;
            held.extend(held_in(
                &page.items,
                self.config.driver.as_str(),
                &self.config.node,
            ));
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => lp = lp.continue_token(&token),
                None => break,
            }
        }
        Ok(held)
    }
}
