//! Delivery guarantee: at_least_once by default (an order may be written twice after a
//! crash, never lost); run with `--set processing.guarantee=exactly_once_v2` for exactly
//! once into Kafka. The join sees the customer table as loaded when the order is
//! processed: a customer update changes later joins, never re-joins earlier orders.
//!
//! Scenario: orders (JSON, topic `orders`) joined with a customer table materialized from
//! the compacted topic `customers` (key = customer id, value = customer JSON, null value =
//! customer deleted). Each order gets its customer under `/customer`; an order whose
//! customer is unknown goes to the dead-letter topic with the reason.
//!
//! ```text
//! cargo run --release --example enrich_orders -- --set dlq.topic=orders.dlq
//! ```
//!
//! Topic names can be changed with ONCEFLOW_EXAMPLE_ORDERS, ONCEFLOW_EXAMPLE_CUSTOMERS and
//! ONCEFLOW_EXAMPLE_OUTPUT. The same topology as a file: topologies/enrich-orders.yaml.

use onceflow::KeySource;
use onceflow::{EnrichSpec, Format, MissingPolicy, TableSpec, Topology, TopologyBuilder};

/// Orders from `orders` joined with the customers of `customers`, written to `output`.
pub fn topology(orders: &str, customers: &str, output: &str) -> Topology {
    TopologyBuilder::new("enrich-orders")
        .source(orders, Format::Json)
        .table(TableSpec::new("customers", customers))
        .enrich(
            "join-customer",
            EnrichSpec::new(
                "customers",
                KeySource::JsonPointer("/customer_id".into()),
                "/customer",
            )
            .on_missing(MissingPolicy::DeadLetter),
        )
        .sink("enriched", output)
        .build()
        .unwrap_or_else(|errors| {
            for e in errors {
                eprintln!("{e}");
            }
            std::process::exit(2)
        })
}

fn main() -> std::process::ExitCode {
    let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    onceflow::deploy::main(topology(
        &var("ONCEFLOW_EXAMPLE_ORDERS", "orders"),
        &var("ONCEFLOW_EXAMPLE_CUSTOMERS", "customers"),
        &var("ONCEFLOW_EXAMPLE_OUTPUT", "orders.enriched"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceflow::{TestDriver, TestRecord};

    #[test]
    fn orders_are_joined_with_their_customer() {
        let mut d = TestDriver::new(topology("orders", "customers", "orders.enriched"));
        d.pipe_table(
            "customers",
            TestRecord::json(r#"{"name":"Ada","country":"UK"}"#).key("c1"),
        )
        .unwrap();
        d.pipe(TestRecord::json(r#"{"order_id":"o1","customer_id":"c1","total":12.5}"#).key("o1"))
            .unwrap();
        d.pipe(TestRecord::json(
            r#"{"order_id":"o2","customer_id":"c2","total":1}"#,
        ))
        .unwrap();
        d.pipe_table("customers", TestRecord::json(r#"{"name":"Bo"}"#).key("c2"))
            .unwrap();
        d.pipe(TestRecord::json(
            r#"{"order_id":"o3","customer_id":"c2","total":2}"#,
        ))
        .unwrap();
        assert_eq!(
            d.output_values("orders.enriched"),
            vec![
                r#"{"order_id":"o1","customer_id":"c1","total":12.5,"customer":{"name":"Ada","country":"UK"}}"#,
                r#"{"order_id":"o3","customer_id":"c2","total":2,"customer":{"name":"Bo"}}"#,
            ]
        );
        assert_eq!(
            d.output("orders.enriched")[0].key.as_deref(),
            Some(&b"o1"[..])
        );
        let dl = d.dead_letters();
        assert_eq!(dl.len(), 1);
        assert_eq!(
            dl[0].value.as_deref(),
            Some(&br#"{"order_id":"o2","customer_id":"c2","total":1}"#[..])
        );
    }
}
