output "inventory" {
  description = "The Ansible inventory (INI) in the layout of inventory.example.ini; write it to a file with `llmctl infra inventory`."
  value       = try(module.inventory.inventory, null)
}

output "gpu_node_addresses" {
  description = "GPU node name to private address."
  value       = try({ for name, p in openstack_networking_port_v2.gpu : name => p.all_fixed_ips[0] }, null)
}

output "service_node_addresses" {
  description = "Service node name to private address."
  value       = try({ for name, p in openstack_networking_port_v2.service : name => p.all_fixed_ips[0] }, null)
}

output "floating_ips" {
  description = "Service node name to floating IP (empty unless enable_floating_ips)."
  value       = try({ for name, f in openstack_networking_floatingip_v2.service : name => f.address }, null)
}

output "security_group_id" {
  description = "Id of the security group every Sarv node is in."
  value       = try(openstack_networking_secgroup_v2.this.id, null)
}

output "network_id" {
  description = "Id of the private network the nodes are attached to."
  value       = try(local.network_id, null)
}
